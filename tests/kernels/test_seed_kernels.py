"""The source documents' own kernels: FlashAttention-4 (``fa4``) and FlashInfer (``flashinfer:prefill``,
``flashinfer:decode``, ``flashinfer:decode_paged``). On the CPU: the registry entries, the refusals and their
messages, the mask conversion, the sentinel read from FlashInfer's header, and the paged decode's page table
and batching through a stand-in for FlashInfer's wrapper that reads the pages it is given. On CUDA (marked gpu, where the packages are
installed): forward (and FA4's backward) against fp64."""
import math
import types

import pytest
import torch

from attnum import kernels
from attnum.kernels import fa4, flashinfer
from attnum.kernels.registry import KernelUnavailable, check_runs


def test_registry_names_and_options():
    assert {"fa4", "flashinfer:prefill", "flashinfer:decode"} <= set(kernels.names())
    assert kernels.get("fa4").name == "fa4"
    assert kernels.get("flashinfer:decode").name == "flashinfer:decode"
    with pytest.raises(ValueError, match="mode in"):
        kernels.get("flashinfer:paged")
    with pytest.raises(ValueError, match="takes no options"):
        kernels.get("fa4:bk128")
    assert kernels.get("flashinfer:decode_paged").page_size == flashinfer.DEFAULT_PAGE_SIZE
    assert kernels.get("flashinfer:decode_paged:p16").name == "flashinfer:decode_paged"  # one name per kernel
    paged8 = kernels.get("flashinfer:decode_paged:p8")
    assert (paged8.name, paged8.page_size) == ("flashinfer:decode_paged:p8", 8)
    for bad in ("flashinfer:prefill:p8", "flashinfer:decode_paged:8", "flashinfer:decode_paged:p0",
                "flashinfer:decode_paged:p8:x"):
        with pytest.raises(ValueError, match="flashinfer"):
            kernels.get(bad)


def test_cpu_refusals_say_why_and_run_nothing():
    for name in ("fa4", "flashinfer:prefill", "flashinfer:decode", "flashinfer:decode_paged"):
        kernel = kernels.get(name)
        reason = kernel.unavailable_reason("cpu")
        assert reason and "CUDA" in reason
        q = torch.randn(1, 1, 8, 16)
        with pytest.raises(KernelUnavailable, match=name):
            kernel.forward(q, q, q)
        assert check_runs(kernel, "cpu") == reason


def test_flashinfer_has_no_backward_and_says_so():
    kernel = kernels.get("flashinfer:prefill")
    assert kernel.has_backward is False and kernels.get("fa4").has_backward is True
    with pytest.raises(KernelUnavailable, match="no backward"):
        kernel.backward(*(torch.randn(1, 1, 4, 8) for _ in range(4)))


def test_flashinfer_mask_is_boolean_and_shared():
    bias = torch.zeros(1, 1, 4, 6)
    bias[..., 4:] = -math.inf
    mask = flashinfer._bool_mask(bias, 4, 6)
    assert mask.dtype == torch.bool and mask.shape == (4, 6)
    assert mask[:, :4].all() and not mask[:, 4:].any()
    with pytest.raises(ValueError, match="boolean mask only"):
        flashinfer._bool_mask(torch.full((4, 6), 0.5), 4, 6)
    with pytest.raises(ValueError, match="one mask for every batch"):
        flashinfer._bool_mask(torch.zeros(2, 1, 4, 6), 4, 6)


@pytest.mark.parametrize("text, expected", [("constexpr float inf = 5e4;", "5e4"),
                                            ("constexpr float inf = cuda::std::numeric_limits<float>::infinity();",
                                             "infinity")])
def test_mask_sentinel_is_read_from_the_installed_header(tmp_path, monkeypatch, text, expected):
    header = tmp_path / "flashinfer" / "data" / "include" / "flashinfer" / "math.cuh"
    header.parent.mkdir(parents=True)
    header.write_text(f"namespace math {{\n{text}\n}}\n")
    fake = types.SimpleNamespace(__file__=str(tmp_path / "flashinfer" / "__init__.py"), __version__="0.0-test")
    monkeypatch.setattr(flashinfer, "_module", lambda: fake)
    assert flashinfer.mask_sentinel() == expected
    assert "0.0-test" in kernels.get("flashinfer:prefill").runs_as() and expected in kernels.get(
        "flashinfer:prefill").runs_as()


def test_fa4_refuses_an_additive_bias_rather_than_dropping_it(monkeypatch):
    kernel = kernels.get("fa4")
    monkeypatch.setattr(kernel, "require", lambda device: None)
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="refused rather than dropped"):
        kernel.forward(q, q, q, attn_bias=torch.zeros(4, 4))


def test_page_table_lists_the_pages_each_row_reads():
    seen = flashinfer.rows_keys(4, 10, causal=True)  # bottom-right causal: rows see 7, 8, 9, 10 keys
    assert seen == [7, 8, 9, 10] and flashinfer.rows_keys(3, 5, causal=False) == [5, 5, 5]
    indptr, indices, last = flashinfer.page_table(seen, 4, first_page=3)
    assert indptr == [0, 2, 4, 7, 10]
    assert indices == [3, 4, 3, 4, 3, 4, 5, 3, 4, 5]
    assert last == [3, 4, 1, 2]
    cache = torch.arange(10.0).view(10, 1, 1)
    pages = flashinfer.paged_cache(cache, 4)
    assert pages.shape == (3, 4, 1, 1) and pages.flatten().tolist() == list(range(10)) + [0, 0]
    for r, n in enumerate(seen):  # the table and the pages give back exactly the first n tokens
        rows = pages[[i - 3 for i in indices[indptr[r]:indptr[r + 1]]]].reshape(-1)
        assert rows[:(indptr[r + 1] - indptr[r] - 1) * 4 + last[r]].tolist() == list(range(n))
    with pytest.raises(ValueError, match="at least one key"):
        flashinfer.rows_keys(6, 4, causal=True)  # the first two rows would see no key


class _PagedStandIn:
    """Reads a paged NHD cache through a CSR page table the way FlashInfer's batch decode is documented to
    (fp64 softmax, base-2 log-sum-exp), so the kernel's page table, batching and layouts can be checked."""

    calls = []

    def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
        assert layout == "NHD" and backend == "fa2" and not use_tensor_cores
        self.calls.append(self)

    def plan(self, indptr, indices, last, heads, kv_heads, d, page_size, *, q_data_type, kv_data_type, sm_scale):
        self.table = (indptr.tolist(), indices.tolist(), last.tolist())
        self.heads, self.kv_heads, self.page_size, self.scale = heads, kv_heads, page_size, sm_scale

    def run(self, q, cache, return_lse):
        indptr, indices, last = self.table
        k_pages, v_pages = cache
        outs, lses = [], []
        for r in range(q.shape[0]):
            pages = indices[indptr[r]:indptr[r + 1]]
            n = (len(pages) - 1) * self.page_size + last[r]
            k = k_pages[pages].reshape(-1, self.kv_heads, q.shape[-1])[:n].double()
            v = v_pages[pages].reshape(-1, self.kv_heads, q.shape[-1])[:n].double()
            s = torch.einsum("hd,nhd->hn", q[r].double(), k) * self.scale
            outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v))
            lses.append(torch.logsumexp(s, -1) / math.log(2.0))
        return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_decode_reads_every_row_from_the_shared_pages(monkeypatch, causal, page_size):
    kernel = kernels.get(f"flashinfer:decode_paged:p{page_size}")
    monkeypatch.setattr(kernel, "require", lambda device: None)
    monkeypatch.setattr(flashinfer, "_module", lambda: types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_PagedStandIn))
    _PagedStandIn.calls.clear()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse = kernel.forward(q, k, v, causal=causal)
    gold, gold_lse = kernels.get("golden").forward(q, k, v, causal=causal)
    assert len(_PagedStandIn.calls) == 1  # every row of every batch element in one batch call
    torch.testing.assert_close(out, gold, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), gold_lse, rtol=1e-6, atol=1e-6)
    pages = -(-9 // page_size)
    assert _PagedStandIn.calls[0].table[1][-1] == 2 * pages - 1  # batch element 1 reads its own pages
    with pytest.raises(ValueError, match="takes no mask"):
        kernel.forward(q, k, v, attn_bias=torch.zeros(5, 9))


# -- on a CUDA device with the packages installed (.ci/gpu-seed-kernels) -------------------------------

def _installed(name):
    return kernels.get(name).unavailable_reason("cuda") is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa4", "flashinfer:prefill", "flashinfer:decode", "flashinfer:decode_paged"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_seed_kernels_forward_against_golden(name, causal):
    if not _installed(name):
        pytest.skip(kernels.get(name).unavailable_reason("cuda"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128 if name.endswith("decode") else 512, 64, generator=gen)
               .to("cuda", torch.bfloat16) for _ in range(3))
    out, lse = kernels.get(name).forward(q, k, v, causal=causal)
    gold, gold_lse = kernels.get("golden").forward(q, k, v, causal=causal)
    assert float((out.double() - gold).norm() / gold.norm()) < 1e-2
    assert float((lse.double() - gold_lse).abs().max()) < 1e-2


@pytest.mark.gpu
def test_cuda_fa4_backward_against_golden():
    if not _installed("fa4"):
        pytest.skip(kernels.get("fa4").unavailable_reason("cuda"))
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, 512, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    grads = kernels.get("fa4").backward(q, k, v, do, causal=True)
    gold = kernels.get("golden").backward(q, k, v, do, causal=True)
    for g, ref in zip(grads, gold):
        assert float((g.double() - ref).norm() / ref.norm()) < 2e-2


def _record(names, device="NVIDIA H200", version="0.7.0"):
    return {"what": "probe", "device": device, "capability": [9, 0], "torch": "2.11", "cuda": "13.0",
            "fa4_version": None, "flashinfer_version": version, "flashinfer_mask_sentinel": "inf",
            "kernels": {n: {"runs_as": n, "unavailable": None, "accuracy": [{"n": i}]} for i, n in enumerate(names)}}


def test_probe_parts_merge_in_the_order_asked_and_refuse_mixed_machines():
    from attnum.kernels.seed_kernels_probe import merge_records
    names = ["flashinfer:prefill", "flashinfer:decode", "flashinfer:decode_paged"]
    parts = [_record([names[2]]), _record([names[0]]), _record([names[1]])]
    merged = merge_records(parts, names)
    assert list(merged["kernels"]) == names
    assert merged["kernels"]["flashinfer:decode_paged"] == parts[0]["kernels"]["flashinfer:decode_paged"]
    assert {k: v for k, v in merged.items() if k != "kernels"} == {k: v for k, v in parts[0].items() if k != "kernels"}
    with pytest.raises(ValueError, match="flashinfer_version"):
        merge_records([_record([names[0]]), _record([names[1]], version="0.6.18.post1")], names[:2])
    with pytest.raises(ValueError, match="device"):
        merge_records([_record([names[0]]), _record([names[1]], device="NVIDIA A100")], names[:2])
    with pytest.raises(ValueError, match="more than one part"):
        merge_records([_record([names[0]]), _record([names[0]])], names[:1])
    with pytest.raises(ValueError, match="no part probed flashinfer:decode_paged"):
        merge_records(parts[1:], names)


@pytest.mark.parametrize("argv, message", [
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--kernels", "fa4,fa4"], "each kernel once"),
    (["--kernels", "flashinfer:bogus"], "flashinfer:<mode>"),
])
def test_probe_refuses_bad_arguments_before_any_work(tmp_path, capsys, argv, message):
    from attnum.kernels.seed_kernels_probe import main
    out = tmp_path / "probe.json"
    assert main([str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
