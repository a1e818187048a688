"""Our own FlashAttention-2 kernel in Triton: forward, backward, and GProj as a compile-time switch.

Forward: Dao, "FlashAttention-2" (2023), Alg. 1 -- query-block outer, a loop over key blocks
inside, online softmax with a running row max ``m`` (raw-score units) and row sum ``l``, the
unnormalised output accumulator kept in registers, one normalisation at the end. Backward: the
same paper's Alg. 2 -- recompute P from the stored log-sum-exp, ``dV = P^T dO``,
``dS = P * (dP - D)``, ``dQ = dS K``, ``dK = dS^T Q``. GProj is seed 004's fix for cause 2
(the report on late-training blowup, docs/sources.md): after dS is rounded to the input format its rows
no longer sum to zero, and the residual ``r_i = sum_j dS~_ij`` multiplies the mean key in dQ.

Numerics (the ``fa2_bf16`` / ``fa2_fp16`` policies of ``attnum.precision``, matched stage by stage
to the emulators ``attnum...flash.flash_attention(loop_order="q_outer", fused_scale_max=False)``
and ``attnum...backward.flash_attention_backward``):

* forward: q, k, v in the input format; ``s = q k^T`` accumulated in fp32; the running max in
  raw-score units; ``p = exp((s - m) * scale)`` -- the max subtracted first, then scaled, so the
  maximum gives exp(0) = 1 exactly (seed 004, cause 1 does not arise); ``l`` summed in fp32 from p
  *before* rounding; ``acc = alpha * acc + round(p) @ v`` with an fp32 accumulator; the output
  ``acc / l`` rounded once to the input format; ``lse = m * scale + log(l)`` stored in fp32.
* backward: dO in the input format; ``D = rowsum(dO * O)`` in fp32 from the stored, rounded O;
  ``P = exp(s * scale - lse)``; dP, dS in fp32; dS and P rounded to the input format before the
  tensor-core matmuls; dQ, dK, dV accumulated in fp32 and stored in the input format.

Where the GPU kernel departs from the emulator at the fp32 level only (far below the unit
roundoff of bf16/fp16, but it can flip a rounding of P or dS that sits on a boundary):
``tl.exp`` is lowered on NVIDIA GPUs to ``ex2.approx(x * log2 e)`` (a few fp32 ulp; exp(0) is
still exactly 1); ptxas may contract ``s * scale - lse`` into one FMA; the P V product is
accumulated into the rescaled accumulator by the MMA (``tl.dot(p, v, acc)``) instead of being
formed first and then added; and fp32 sums run in the hardware's order. In the CPU interpreter
``tl.exp`` is numpy's fp32 exp.

Causal masking is top-left aligned and needs ``n_q == n_k`` (query i sees keys j <= i); the
module raises otherwise (q, k, v must have the same sequence length in every case). With
``n_q == n_k`` no row is fully masked. Sequence lengths need not be multiples of the block sizes
(masked loads and stores); head dims 16, 32, 64, 128 (any size up to 256 works, padded to the
next power of two).

Masks only where they can matter (compile-time switches; the arithmetic is unchanged). Each loop
over blocks (the forward's and the dQ kernel's over key blocks, the dK/dV kernel's over query
blocks) runs the same blocks in the same order as one masked loop would, but split in two or three
loops: blocks wholly below the diagonal (causal) or wholly inside [0, N) (not causal) compute no
mask at all (no ``tl.where``, no bounds masks on their loads); only the diagonal blocks apply the
causal mask, and only the last, partial block (N % BLOCK) the bounds mask. ``EVEN_N`` (N a multiple
of both of a kernel's block sizes) also drops the row masks of the program's own loads and stores,
and ``EVEN_D`` (d a power of two >= 16) the head-dim masks. A ``tl.where`` that keeps every element
and a masked load whose mask is all true give the same values, and the online softmax sees the
blocks in the same order, so the result is bit for bit that of the every-block-masked path, which
is kept as the reference (``_split=False``; the interpreter tests compare the two with
``torch.equal``, and ``triton_fa2_tune --split-check`` does on the GPU, where ptxas compiles the
split loops as separate code and could in principle contract an expression differently -- the
fp32-level latitude above). In a causal run about 1/(number of key blocks per row) of the tiles
are diagonal, so nearly all of the masking work goes.

TMA loads (``BlockConfig.tma``, or one kernel's own ``fwd_tma`` / ``dq_tma`` / ``kv_tma``; off in a bare
``BlockConfig``, and switched on per kernel in the ``TUNED_CONFIGS`` entries where ``triton_fa2_tune
--parts=tma --rounds=5`` measured a gain: at d = 128 for most kernels, at d = 64 for one kernel each; the
entries' comments give the times). A launch option like warps and stages: it
changes how tiles reach shared memory, never the arithmetic. With it, every inner-loop tile whose
load needs no mask -- K and V in the forward and the dQ kernel, Q and dO in the dK/dV kernel: the
split's unmasked blocks, and the diagonal blocks when ``EVEN_N`` -- is loaded through a host-side
Triton tensor descriptor over the [B*H*N, d] view (row ``bh * N + start``; Hopper's tensor memory
accelerator on the GPU); masked loads (the bounds tail, and everything on the ``_split=False``
reference path) and each program's own tiles keep the pointer loads, since a descriptor's rows past a
head's N are the next head's, not zeros. The same values are loaded either way, so the outputs are
meant to be bit for bit those without it (the interpreter tests check this with ``torch.equal``; on
the GPU ``test_gpu_tma_bitwise`` and ``triton_fa2_tune --same-numerics=D:tma=1`` do). It needs a
power-of-two head dim >= 16 (``EVEN_D``), 16-byte aligned tensors, B*H*N < 2^31 and, on CUDA,
compute capability >= 9.0; otherwise ``forward``/``backward`` raise ValueError before any launch when a
``config=`` asks for them (never a silent fall-back to the pointer loads), while the tuned default
configuration (``config=None``) loads through pointers there, and for fp16 and fp32 inputs: the same bits
either way (``_default_tma``).
Triton 3.6's CPU interpreter runs tensor descriptors (as masked pointer loads), so there it is accepted and
tested.

Launch order (``BlockConfig.heavy_first``; opt-in, causal only). Under the causal mask the query block at
``start_m`` visits ``start_m / BLOCK_N + 1`` key blocks, so in the forward and the dQ kernel (query-block
outer) the programs grow heavier with their grid index, and the GPU, which starts programs in grid order
(head after head, block after block within a head), leaves the heaviest blocks of the last head for the last
wave: its tail runs a full row of key blocks while most SMs idle. With ``heavy_first`` program ``i`` of a head
owns query block ``n_blocks - 1 - i``, so each head's heaviest blocks start first and the lightest fill the
last wave (the longest-processing-time-first rule of list scheduling, Graham, "Bounds on multiprocessing
timing anomalies", SIAM J. Appl. Math. 1969). Neighbouring programs still share one head's K
and V in L2. Each program computes exactly what it computed before, so the outputs are bit for bit the
same (the interpreter tests compare with ``torch.equal``; on the GPU ``test_gpu_heavy_first_bitwise``). The
dK/dV kernel (key-block outer) needs no switch: its first key blocks already see the most query blocks.
Measured on the H200 (``triton_fa2_tune --parts=order --rounds=5``, N = 8192, 2^18 tokens) it saved nothing
worth a switch: forward and dQ kernel 1.397 + 1.690 ms without against 1.383 + 1.695 ms with it at d = 128,
0.914 + 1.057 against 0.911 + 1.127 ms at d = 64, so no tuned entry turns it on. At that shape a head has 128
query blocks and the grid about 4096 programs, so the last wave is a small share of the run; a shape with few
heads and a long N has a larger one, and this switch is there to measure it.

Overlap (``BlockConfig.dq_overlap``, ``kv_overlap``; in the tuned entries where they measured a gain). Triton 3.6
on sm_90 issues each tile GEMM as an asynchronous warpgroup MMA and waits for it where its result is next read: a
GEMM whose result feeds the same iteration (S, dP) is waited for at once, and in the d = 128 loops that load
through TMA the accumulating products stay in flight until the next such wait (in the TTGIR we read of the d = 128
dQ kernel with pointer loads every product was waited for at once; yet the switches also measured faster with
pointer loads at d = 64 and in the dK/dV kernel, so the tune decides, not the TTGIR). Where an accumulating product
is issued therefore decides what it can overlap. In the dQ kernel GProj's ``P~ K`` is written after dS~ K by
default, so it overlaps only the row sum of dS~ and the next tile's loads; with ``dq_overlap`` it is issued as
soon as dP has arrived, before dS = P * (dP - D) and its rounding, which then run on the CUDA cores while the
product is on the tensor cores. In the dK/dV kernel
dV += P~^T dO is issued before dP^T = V dO^T by default, and the wait for dP^T takes both; with ``kv_overlap`` dV's
product is issued after that wait, beside dS^T's elementwise work. Each accumulator receives the same products
in the same order, so the outputs are bit for bit the same (interpreter tests with ``torch.equal``; on the GPU
``test_gpu_overlap_bitwise``); whether it pays is measured per kernel and shape (``triton_fa2_tune
--parts=overlap``, crossed with the kernel's TMA switch), since moving a product earlier also holds its operands'
registers longer. On the H200 (the tables' comments) ``kv_overlap`` took 2-15% off the dK/dV kernel (15% under
GProj dq_dk at d = 128, where the correction's product also overlaps) and ``dq_overlap`` 1-8% off GProj's dQ
kernel (with its TMA switch); every tuned entry turns them on.

exp2 (``BlockConfig.exp2``, or one kernel's own ``fwd_exp2`` / ``dq_exp2`` / ``kv_exp2``; in the tuned entries where
they measured a gain). Since exp(x) = 2^(x log2 e), the constant log2 e can be folded into the softmax scale once
per program, as FlashAttention-2's CUDA kernels do (Dao-AILab/flash-attention, csrc/flash_attn/src/softmax.h, the
code PyTorch's SDPA flash backend vendors), so that each exponent argument costs one multiply less:
``p = exp2((s - m) * fl(scale log2 e))`` and ``alpha = exp2((m_old - m_new) * fl(scale log2 e))`` in the forward,
``P = exp2(s * fl(scale log2 e) - fl(lse log2 e))`` in the backward kernels. The stored LSE stays in natural-log
units (``m * scale + log l``), so forward and backward kernels with and without it combine. Unlike the schedule
switches this changes the arithmetic. In the forward exp sees ``fl(fl(s - m) * scale)`` and exp2
``fl(fl(s - m) * fl(scale log2 e))``; on NVIDIA GPUs Triton lowers fp32 ``tl.exp`` to ``ex2.approx(x * log2 e)``
(above), so there exp2 drops one fp32 multiply and its rounding. A rounding moves the base-2 argument y by at most
|y| u_fp32 (u_fp32 = 2^-24) and p by a relative |y| ln 2 u_fp32: under 1e-6 for p >= 2^-24 (|y| <= 24), 5.2e-6
at bf16's smallest normal 2^-126, against the unit roundoffs 2^-8 (bf16) and 2^-11 (fp16) of rounding P; s = m
still gives exactly 1 (seed 004's cause 1 does not arise). Where the scale is a power of two (1/sqrt(d) at d = 16,
64, 256) the dropped rounding is exact: fl(scale log2 e) = scale fl(log2 e) and fl(fl(s - m) scale) = fl(s - m)
scale, so on NVIDIA GPUs the exp2 forward gives the exp forward's bits
(``test_gpu_exp2_matches_fp64_and_stays_near_exp`` checks it at d = 64; at d = 128 the LSE moves). In the backward
the argument is a difference: the roundings of ``s * fl(scale log2 e)`` and of ``lse log2 e`` move it by u_fp32
times |s scale| and |lse| (in base-2 units), the same order as the exp kernel's own rounding of ``s * scale`` and of
the stored LSE. Either way such a change can flip a rounding of P~ or dS~ that sits on a boundary, like the
fp32-level latitude above. In the CPU interpreter exp is numpy's exp and exp2 numpy's exp2; the interpreter tests
hold the exp2 kernels to the exp kernels' fp64 tolerances and to GProj's floor (``test_interpreter_exp2_*``), and
the GPU test (``test_gpu_exp2_matches_fp64_and_stays_near_exp``) in bf16 at the tuned tiles. Measured on the H200
(``triton_fa2_tune --parts=exp2 --rounds=5``, N = 8192, each kernel alone at the table's configuration, median of
rounds, two runs; the ``TUNED_CONFIGS`` comment gives the times and the file) it took 3.6-12.4% off the forward and
the dQ kernel at d = 64 and 128, causal and not, 0.5-8.3% off GProj's dQ kernel and 1.5-6.5% off the non-causal
dK/dV kernel, but made the causal dK/dV kernel 21-22% slower at both head dims, in every round (why was not
measured); at d = 64 the forward's gain (7-12%) comes with the same bits (above); the tuned entries turn it on where
it was faster. The FP32 backward's kernels (fp32 operands) keep exp unless an entry of their own says otherwise,
since it was timed on the bf16 kernels only. GPU runs committed before this switch entered the tuned entries (the
study outputs' RUN.json files give each run's commit) computed every exponential with exp.

Backward structure (choice and cost). Two kernels after the D preprocessing, no atomics:

1. ``_bwd_dq_kernel``: query-block outer, loop over key blocks; recomputes S, P, dP, dS and
   accumulates ``dQ += dS~ K_j`` in registers. Three matmuls per tile (Q K^T, dO V^T, dS~ K).
2. ``_bwd_dkdv_kernel``: key-block outer, loop over query blocks; recomputes S^T, P^T, dP^T,
   dS^T and accumulates ``dV += P~^T dO``, ``dK += dS~^T Q``. Four matmuls per tile.

Recomputing S and dP in both kernels costs 7 tile matmuls where a single key-outer kernel with
atomic fp32 adds into dQ costs 5 (+40% backward matmul FLOPs), in exchange for a deterministic
dQ with no atomics and no fp32 dQ scratch buffer; the Triton tutorial's fused-attention backward
makes the same trade. The dQ kernel runs first so that GProj's ``r`` is ready for dK.

GProj (``gproj``, a ``tl.constexpr``; seed 004):

* ``"off"``: the algorithm above.
* ``"dq"``: in the dQ kernel, ``r_i = sum_j dS~_ij`` (fp32 sum of the rounded values) and
  ``(P~ K)_i`` are accumulated beside dQ over all key blocks, and once the loop ends
  ``dQ_i -= r_i (P~ K)_i`` (then the common ``* scale``). Cost: one extra matmul per dQ tile
  (P~ K_j; 4 instead of 3, so 8 instead of 7 in the whole backward) and a second BLOCK_M x d
  fp32 accumulator in registers; no extra pass, no extra memory traffic.
* ``"dq_dk"``: ``"dq"``, plus the dQ kernel writes r (fp32, one value per query row) to memory,
  and the dK/dV kernel, which runs after it, reads ``r_i`` with each query block and feeds
  ``dS~ - round(r_i P~_ij)`` to dK's fp32 accumulator as two operands: ``dK += dS~^T Q`` and
  ``dK -= round(r P~)^T Q`` (the correction is rounded like P~, the difference is never rounded,
  as in the emulator). Cost: one more matmul per dK/dV tile (5 instead of 4; 9 of 7 in all),
  4 bytes per query row written and re-read per key block. The extra *pass* the emulator needs
  for r is free here because the separate dQ kernel already is that pass.

GProj's cost, and what was considered to lower it. The emulator fixes the
arithmetic: ``dQ_i = sum_j dS~_ij K_j - r_i (P~ K)_i`` with ``r_i`` the fp32 sum of the rounded row
and ``P~ K`` an fp32 product of the rounded P, the correction applied once after the key loop. (a)
Folding the correction into the operand, ``sum_j (dS~_ij - r_i P~_ij) K_j``, saves the P~ K matmul
but needs r_i before the loop (a second pass over S and dP: 2 matmuls a tile to save 1) and rounds
differently; rejected. (b) One matmul of the stacked ``[dS~; P~]`` (2 BLOCK_M x BLOCK_N) with K_j
has the same FLOPs as the two products and costs a register-layout shuffle to stack; rejected. (c)
``r_i`` as a matmul (K_j with a column of ones appended) needs a spare head-dim column, which the
power-of-two head dims 64 and 128 do not have; the row sum of dS~ is a 4-lane shuffle reduction a
tile, small against the three matmuls. What remains is the schedule: the extra fp32 BLOCK_M x d
accumulator raises register pressure (at 64 x 128 with 4 warps: 2 x 64 KiB of fp32 over 128
threads), which is why GProj's warps and stages are tuned on their own (``TUNED_GPROJ_LAUNCH``,
the tiles held equal to GProj off's so GProj on and off differ by the GProj arithmetic alone), and
the P~ K product reuses the K tile and P already in registers for dS~ K (no extra load, no extra
exponential; rounding P to the input format is its one extra elementwise step). Under ``dq_dk`` the dK/dV
kernel's extra cost is the fifth matmul and the load of r (4 bytes a query row per key block).

Why the extra GEMM is only partly hidden (measured). In the dQ kernel compiled for sm_90 by Triton 3.6, each tile
GEMM whose result is used in the same loop iteration (Q K^T, dO V^T) is followed at once by a wait for all
outstanding warpgroup MMAs (``warp_group_dot_wait {pendings = 0}`` in the TTGIR), and only the accumulating
products (dS~ K, P~ K) stay in flight, until the next tile's first wait. Issuing dO V^T before P's exponentials
changes nothing (the wait follows each dot). Without ``dq_overlap`` GProj's P~ K overlaps only the row sum; with it,
also dS's elementwise work (above, "Overlap"). On the H200 (``outputs/kernels/h200/README.md``) GProj dq's extra
backward time was 0.64-1.11 of one backward tile GEMM's time at d = 128 before the overlap switches (the
``tuned_tma`` bench files; ``summary``'s ``gproj_dq_extra_bwd_gemms``: the extra time over 1/7 of the GProj-off
backward) and 0.48-1.27 with them (the ``overlap`` bench files), 0.13-1.56 at d = 64, where the rounding and
row-sum work per tile is large beside the GEMM. One GEMM's time is about 1/9 to 1/10 of forward + backward at
d = 128, so in those files GProj dq still costs +5.0% to +13.4% of forward + backward there and dq_dk +17.8% to
+24.7%: the targets of +5% and +15% (``triton_fa2_bench.TARGETS``) need more of the products to overlap or to
shrink. ``triton_fa2_bench bound`` states what they ask of the tensor cores: at d = 128 non-causal, the rate of
backward GEMMs that would meet them is above the rate of every backward pass timed on the H200, FA4's included
(``outputs/kernels/h200/README.md``).

GProj's row sum. ``r_i`` was first a register reduction each key block, ``r += sum_j float(dS~_ij)``: each thread
adds the elements of the tile it holds and the row's lanes combine theirs by shuffles. On the H200 that reduction
cost GProj's dQ kernel more than its extra product did (``triton_fa2_ablate``, which times copies of this module
with the row sum or the P~ K product deleted; its file is in ``outputs/kernels/h200/README.md``): deleting the row
sum took away more of GProj's extra time than deleting the product at every shape timed. ``BlockConfig.dq_rsum_mma``
forms r on the tensor cores instead, as a product of dS~ -- already in registers as the A operand of dS~ K -- with a
[BLOCK_N, 16] operand of ones in its first column and zeros in the others (16: ``tl.dot``'s smallest width),
accumulated in a [BLOCK_M, 16] fp32 accumulator whose first column is r once the loop ends (the other columns hold
exact zeros and are masked off). Each product dS~_ij * 1 is exact, so r is the same sum of the same rounded values,
formed in the tensor cores' order and accumulation instead of the registers'; like every fp32 order change here it
can move a dQ or dK element by one rounding where a value sits on a boundary (how many and how far is bounded by
``test_gpu_rsum_mma_meets_fp64_and_stays_near_the_register_sum``). Its cost is one product of width 16 beside
products of width d. It applies to bf16 and fp16 inputs with GProj on and the FP32 backward off (fp32 inputs and
the FP32 backward keep the register sum, whose fp32 operands would leave the tensor cores). The tables turn it on
where the sweep measured a gain (``TUNED_CONFIGS``' comment); at d = 64 causal, at 64 x 128 dQ tiles, it was slower
at every launch tried.

``fp32_backward``: P and dS are kept in fp32 for the dV, dQ and dK matmuls (and dO, Q, K are
upcast exactly to fp32 as the other operands), with ``input_precision="ieee"`` so that no fp32
dot is silently rounded to TF32: what "FP32 attention backward" costs in the same kernel (the
fp32 dots leave the tensor cores). Every other ``tl.dot`` of this module passes
``input_precision="ieee"``; for fp16/bf16 operands it changes nothing.

``fp32_dot="tf32x3"`` (opt-in, FP32 backward only; the default stays ``"ieee"``): Triton's 3xTF32
(``tl.dot(..., input_precision="tf32x3")``, NVIDIA): each fp32 operand x is split as x = hi + lo,
hi = tf32(x), lo = tf32(x - hi), and the product is hi_a hi_b + hi_a lo_b + lo_a hi_b on the tensor
cores with fp32 accumulation (lo_a lo_b dropped). hi + lo keeps about 22 of fp32's 24 significand
bits, so each product is within a few 2^-22 relative of the fp32 one: close to, but not bit for
bit, the ``"ieee"`` kernel, and far below the input formats' unit roundoff (bf16 2^-8, fp16
2^-11). Here one operand of every fp32 dot is an exact upcast of a bf16/fp16 tensor (K, dO, Q),
whose significand fits TF32's 11 bits, so its lo is 0 and only the fp32 P or dS operand is split.
The sums in the tensor cores run in their own order and rounding, as for every MMA here. In the
CPU interpreter ``input_precision`` is ignored (every dot is a numpy fp32 matmul), so there the two
agree exactly; on the GPU ``test_gpu_fp32_dot_tf32x3`` bounds the difference.

``fp32_dot="bf16x3"`` (opt-in, FP32 backward of bf16 inputs only): the same idea with nothing
dropped. The other operand of every fp32 dot (K, dO, Q) *is* a bf16 tensor, so only the fp32 P or
dS operand a needs splitting, and bf16 has fp32's exponent range: ``a = hi + mid + lo`` with
``hi = bf16(a)``, ``mid = bf16(a - hi)``, ``lo = bf16(a - hi - mid)`` holds exactly for
|a| >= 2^-103 (each difference is exact in fp32 and three 8-bit significands cover fp32's 24;
``_split3``, checked bit for bit by the interpreter tests). Below that the lower pieces reach
the subnormals and may lose bits: an element of P or dS under 2^-103 is far below the fp32
resolution of any sum it enters unless the whole row is that small. Each of the three bf16 x bf16
products is exact in fp32, so the dot is ``a @ b`` up to the order and rounding of the fp32 sums
alone -- the same latitude as
the ``"ieee"`` dot, whose products are each rounded to fp32 once -- at the bf16 tensor-core rate:
three bf16 dots where the bf16 kernel has one, against ieee's dot off the tensor cores. The fp32
pieces are register operands and K, Q, dO stay bf16 in shared memory, so it keeps the bf16
kernel's tiles (``default_config``). On the GPU ``test_gpu_fp32_dot_bf16x3`` bounds its difference
from ``"ieee"``; the interpreter's bf16 ``tl.dot`` is wrong (fp16 and fp32 are right), so the
CPU tests cover the split and the refusals only.

Block sizes (``BlockConfig``): autotune-free constants for the H200 (Hopper, 228 KiB shared
memory per SM, 64K registers), per (head dim, causal) in ``TUNED_CONFIGS`` (picked from
``triton_fa2_tune``'s sweep, which times the forward, the dQ kernel and the dK/dV kernel each
alone; every entry says where it came from), with per-kernel warps and stages and GProj's own
warps/stages in ``TUNED_GPROJ_LAUNCH``. Head dims outside the table fall back to the untuned
constants: forward BLOCK_M = 128 query rows by BLOCK_N = 64 keys; the dQ kernel 128 query rows by
64 keys; the dK/dV kernel 128 keys by 64 query rows; 4 warps for d <= 64 and 8 above;
``num_stages`` 3 forward and 2 backward. The fp32 backward halves the backward tiles (fp32
operands take twice the shared memory) unless ``TUNED_FP32_BWD`` has its own. Tests pass small
blocks through ``config=``. Numerics of a tuned default: warps and stages never change the
arithmetic, but the tiles set which partial sums are formed and rounded together (the fp32 order of
the row max / row sum updates and of the MMA accumulation), so a kernel at other tiles is a
different kernel at the fp32 level -- every bf16/fp16 rounding rule above is the same, and the
emulator matches it at its own tiles (``block_q``/``block_k``) -- and its outputs can differ from
the old default's in the last bit of the input format where an fp32 value sits on a rounding
boundary. ``triton_fa2_tune --same-numerics`` measures exactly that.
Measured speed lives in ``outputs/kernels/h200/triton_fa2_bench*.json`` (``triton_fa2_bench``: against
SDPA's backends, compiled FlexAttention and FA4 where installed; the dated files carry a ``summary``
against the speed targets, with the ``bf16x3`` FP32 backward among ``extra_cases``) and the sweeps in
``triton_fa2_tune*.json``; this docstring states no timings, since they change with every table.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch

try:  # never fail at import: CI has no GPU and perhaps no triton
    import triton
    import triton.language as tl
except Exception as exc:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

GPROJ_MODES = ("off", "dq", "dq_dk")
_GPROJ_CODE = {"off": 0, "dq": 1, "dq_dk": 2}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch parameters. ``fwd_m``/``fwd_n``: forward query rows / keys per tile;
    ``dq_m``/``dq_n``: the dQ kernel's; ``kv_n``/``kv_m``: the dK/dV kernel's (keys outer).

    ``num_warps`` and ``bwd_stages`` are the shared defaults; ``fwd_warps``, ``dq_warps``,
    ``kv_warps`` and ``dq_stages``, ``kv_stages`` (None: the shared value) set one kernel's own.
    ``tma`` (opt-in): the inner loops' unmasked tiles (K, V in the forward and the dQ kernel, Q, dO in
    the dK/dV kernel) are loaded through tensor descriptors (TMA on Hopper) instead of pointer loads;
    needs a power-of-two head dim >= 16 and, on CUDA, compute capability >= 9.0 (module docstring,
    "TMA loads"). ``fwd_tma``, ``dq_tma``, ``kv_tma`` (None: the shared ``tma``) set one kernel's own.
    ``heavy_first`` (causal runs only): the forward and dQ kernels take their query blocks last block first
    (module docstring, "Launch order").
    ``dq_overlap`` (GProj only): the dQ kernel issues GProj's P~ K product before dS's elementwise work;
    ``kv_overlap``: the dK/dV kernel issues dV's product after dP's, before dS's elementwise work (module
    docstring, "Overlap").
    ``dq_rsum_mma`` (off in a bare ``BlockConfig``; GProj only): GProj's row sum r as a product of dS~ with a column
    of ones on the tensor cores (module docstring, "GProj's row sum"); it changes the order of r's sum.
    ``exp2`` (off in a bare ``BlockConfig``): every exponential as exp2 with log2 e folded into the scale (module
    docstring, "exp2"); it changes the arithmetic (one fp32 rounding fewer per exponent argument), unlike the
    schedule switches. ``fwd_exp2``, ``dq_exp2``, ``kv_exp2`` (None: the shared ``exp2``) set one kernel's own.
    Warps, stages, ``tma``, ``heavy_first`` and the overlap switches change only the schedule, never the
    arithmetic (``SCHEDULE_FIELDS``); tiles change the fp32 summation order (see the module docstring, "Block
    sizes")."""
    fwd_m: int = 128
    fwd_n: int = 64
    dq_m: int = 128
    dq_n: int = 64
    kv_n: int = 128
    kv_m: int = 64
    num_warps: int = 4
    fwd_stages: int = 3
    bwd_stages: int = 2
    fwd_warps: int | None = None
    dq_warps: int | None = None
    kv_warps: int | None = None
    dq_stages: int | None = None
    kv_stages: int | None = None
    tma: bool = False
    fwd_tma: bool | None = None
    dq_tma: bool | None = None
    kv_tma: bool | None = None
    heavy_first: bool = False
    dq_overlap: bool = False
    kv_overlap: bool = False
    exp2: bool = False
    fwd_exp2: bool | None = None
    dq_exp2: bool | None = None
    kv_exp2: bool | None = None
    dq_rsum_mma: bool = False

    def __post_init__(self):
        for name in ("tma", "heavy_first", "dq_overlap", "kv_overlap", "exp2", "dq_rsum_mma"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("fwd_tma", "dq_tma", "kv_tma", "fwd_exp2", "dq_exp2", "kv_exp2"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}")
        for name in ("fwd_m", "fwd_n", "dq_m", "dq_n", "kv_n", "kv_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {value}")
        for name in ("num_warps", "fwd_warps", "dq_warps", "kv_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("fwd_stages", "bwd_stages", "dq_stages", "kv_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def launch(self, kernel: str) -> tuple[int, int]:
        """``(num_warps, num_stages)`` of ``kernel`` in {"fwd", "dq", "kv"}."""
        if kernel == "fwd":
            return self.fwd_warps or self.num_warps, self.fwd_stages
        if kernel == "dq":
            return self.dq_warps or self.num_warps, self.dq_stages or self.bwd_stages
        if kernel == "kv":
            return self.kv_warps or self.num_warps, self.kv_stages or self.bwd_stages
        raise ValueError(f"kernel must be 'fwd', 'dq' or 'kv', got {kernel!r}")

    def uses_tma(self, kernel: str) -> bool:
        """Whether ``kernel`` in {"fwd", "dq", "kv"} loads its inner-loop tiles through tensor descriptors."""
        return self._own_or_shared(kernel, "tma")

    def uses_exp2(self, kernel: str) -> bool:
        """Whether ``kernel`` in {"fwd", "dq", "kv"} computes its exponentials as exp2 (module docstring, "exp2")."""
        return self._own_or_shared(kernel, "exp2")

    def _own_or_shared(self, kernel: str, switch: str) -> bool:
        """``kernel``'s own ``{kernel}_{switch}`` where set, else the shared ``switch``."""
        if kernel not in ("fwd", "dq", "kv"):
            raise ValueError(f"kernel must be 'fwd', 'dq' or 'kv', got {kernel!r}")
        own = getattr(self, f"{kernel}_{switch}")
        return getattr(self, switch) if own is None else own

    def tiles(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in TILE_FIELDS}


TILE_FIELDS = ("fwd_m", "fwd_n", "dq_m", "dq_n", "kv_n", "kv_m")
LAUNCH_FIELDS = ("num_warps", "fwd_stages", "bwd_stages", "fwd_warps", "dq_warps", "kv_warps", "dq_stages",
                 "kv_stages")
# Fields that change how a kernel is scheduled but never what it computes (the same bits): with LAUNCH_FIELDS,
# the only fields GProj's own entries (TUNED_GPROJ_LAUNCH) may set.
SCHEDULE_FIELDS = ("tma", "fwd_tma", "dq_tma", "kv_tma", "heavy_first", "dq_overlap", "kv_overlap")

# Tuned H200 defaults per (head_dim, causal): bf16, N = 8192, 2^18 tokens a shape (triton_fa2_tune).
# Entries are BlockConfig fields; "source" says where each came from. Rebuild it with
# ``python -m attnum.kernels.triton_fa2_tune pick TUNE.json [...]``, which prints this table.
TUNED_CONFIGS: dict[tuple[int, bool], dict] = {
    # d = 128: outputs/kernels/h200/triton_fa2_tune.json (2026-12-02): forward 64 x 64 / 4 warps /
    # 3 stages (3.00 ms against 3.80 non-causal, 1.76 against 2.24 causal), backward 64-tiles / 4
    # warps / 2 stages (7.79 against 9.78 ms, 4.47 against 5.74 causal; both kernels the same there)
    # TMA loads (every entry): outputs/kernels/h200/triton_fa2_tune_tma_order_r5_2026-12-03.json, each kernel
    # alone at these tiles with its own switch off and on, 5 alternating rounds (median of rounds, ms off -> on):
    # d = 128 non-causal fwd 2.640 -> 2.363, dQ 3.391 -> 3.009, dK/dV 4.228 -> 3.933 (all on); causal fwd 1.430
    # -> 1.385, dK/dV 2.281 -> 2.128 (on), dQ 1.740 -> 1.747 (off). The loads change no arithmetic: these
    # switches leave every output bit for bit as it was (--same-numerics=D:tma=1, test_gpu_tma_bitwise).
    # Overlap (every entry; the dK/dV kernel's kv_tma and kv_overlap, GProj off):
    # outputs/kernels/h200/triton_fa2_tune_overlap_r5_2026-12-03.json (triton_fa2_tune --parts=overlap --rounds=5,
    # median of rounds, ms, the table's switches -> the choice): d = 128 non-causal 4.085 -> 3.788 (tma on,
    # overlap on; faster in 5 of 5 rounds), causal 2.179 -> 2.145 (on, on; 2 of 5); d = 64 non-causal 2.565 ->
    # 2.352 (tma off, overlap on; 5 of 5), causal 1.491 -> 1.382 (on, on; 4 of 5). Same bits either way
    # (test_gpu_overlap_bitwise).
    # exp2 (module docstring, "exp2"; it changes the arithmetic): triton_fa2_tune --parts=exp2 --rounds=5, each
    # kernel alone at these configurations with its own switch off and on, median of 5 alternating rounds, ms off ->
    # on; first at bc3c0f5 (that run's JSON was lost with its machine), then again at f21f159, whose tables already
    # carried these switches (outputs/kernels/h200/triton_fa2_tune_exp2_r5_2026-12-04.json), first run / repeat:
    # d = 128 non-causal fwd 2.447 -> 2.270 / 2.604 -> 2.425, dQ 3.222 -> 2.934 / 3.259 -> 2.975, dK/dV 4.056 ->
    # 3.830 / 4.098 -> 3.833 (GProj's dQ 4.005 -> 3.860 / 3.959 -> 3.816); causal fwd 1.414 -> 1.320 / 1.437 ->
    # 1.344, dQ 1.787 -> 1.723 / 1.860 -> 1.742, dK/dV 2.188 -> 2.676 / 2.270 -> 2.768 (exp2 faster in 0 of 5
    # rounds: kept off); d = 64 non-causal fwd 1.748 -> 1.537 / 1.701 -> 1.490, dQ 1.701 -> 1.557 / 1.724 ->
    # 1.626, dK/dV 2.459 -> 2.421 / 2.533 -> 2.490; causal fwd 0.999 -> 0.897 / 1.005 -> 0.937, dQ 1.141 ->
    # 1.025 / 1.148 -> 1.038, dK/dV 1.585 -> 1.933 / 1.609 -> 1.944 (off). GProj's dQ kernel shares the dQ
    # kernel's switch.
    # The causal dK/dV kernel with exp2 at other tiles and launches (triton_fa2_tune_kv_causal_exp2_{0,1}_2026-12-04
    # .json, --parts=kv with kv_exp2 off, then on): its best exp2 launch 2.604 ms at d = 128 against 2.076 ms with
    # exp at this entry's, 1.402 against 1.401 at d = 64; exp stays there.
    # GProj's row sum as a product (dq_rsum_mma; module docstring, "GProj's row sum"; it changes the order of r's
    # sum): outputs/kernels/h200/triton_fa2_tune_rsum_r3_2026-12-04.json (--parts=rsum --rounds=3, GProj's dQ
    # kernel alone, median of rounds, ms, in registers -> as a product, at the GProj launch below): d = 128
    # non-causal 3.602 -> 3.481 (faster in 2 of 3 rounds), causal 1.864 -> 1.794 (3 of 3); d = 64 non-causal 2.204
    # -> 1.804 (3 of 3); d = 64 causal 1.162 -> 1.996 at its launch, 1.479 at the product's fastest (4 warps, 1
    # stage; faster in 0 of 3 rounds): off there.
    (128, False): dict(fwd_m=64, fwd_n=64, dq_m=64, dq_n=64, kv_n=64, kv_m=64, num_warps=4, fwd_stages=3,
                       bwd_stages=2, fwd_tma=True, dq_tma=True, kv_tma=True, kv_overlap=True, fwd_exp2=True,
                       dq_exp2=True, kv_exp2=True, dq_rsum_mma=True,
                       source="h200 tune 2026-12-02 (whole backward, dQ and dK/dV tiles tied); TMA 2026-12-03; "
                              "overlap 2026-12-03; exp2 2026-12-04; GProj row sum 2026-12-04"),
    (128, True): dict(fwd_m=64, fwd_n=64, dq_m=64, dq_n=64, kv_n=64, kv_m=64, num_warps=4, fwd_stages=3,
                      bwd_stages=2, fwd_tma=True, dq_tma=False, kv_tma=True, kv_overlap=True, fwd_exp2=True,
                      dq_exp2=True, kv_exp2=False, dq_rsum_mma=True,
                      source="h200 tune 2026-12-02 (whole backward, dQ and dK/dV tiles tied); TMA 2026-12-03; "
                             "overlap 2026-12-03; exp2 2026-12-04; GProj row sum 2026-12-04"),
    # d = 64, non-causal: triton_fa2_tune --dims=64 --parts=fwd,dq,kv,dq_gproj,kv_gproj on the H200
    # (2026-12-02, each kernel timed alone): forward 128 x 64 / 8 warps / 3 stages 1.594 ms, dQ kernel
    # 64 x 64 / 4 warps / 2 stages 1.64 ms, dK/dV kernel 64 x 64 / 4 warps / 3 stages 2.661 ms (that
    # sweep's JSON was lost). The sweep of outputs/kernels/h200/triton_fa2_tune_d64_2026-12-03.json
    # repeats it: the same forward (1.614 ms) and dK/dV (2.664 ms) picks; its fastest dQ kernel is
    # 128 x 64 / 8 warps / 3 stages (1.646 ms against 1.745 ms here), but GProj's dQ kernel, which
    # runs at these tiles, took 2.825 ms there against the earlier sweep's 2.612 ms at 64 x 64, so the
    # 64 x 64 dQ tiles stay (and with them this entry's numerics). TMA (the r5 sweep above): dQ 1.644 -> 1.612
    # ms (on: faster in each of the 5 rounds), forward 1.674 -> 1.735 and dK/dV 2.516 -> 2.500 (off).
    # With exp2 the forward's fastest tile moved: triton_fa2_tune --parts=fwd --dims=64 --rounds=3 at f21f159
    # (outputs/kernels/h200/triton_fa2_tune_fwd_d64_exp2_n{4096,8192}_2026-12-04.json, median of rounds):
    # 64 x 64 / 4 warps / 3 stages 1.358 ms at N = 8192 and 0.720 at N = 4096, against this entry's former
    # 128 x 64 / 8 warps / 3 stages 1.395 and 0.738; its TMA loads 1.437 -> 1.424 ms (under 1%: off).
    (64, False): dict(fwd_m=64, fwd_n=64, dq_m=64, dq_n=64, kv_n=64, kv_m=64, num_warps=4, fwd_warps=4,
                      fwd_stages=3, bwd_stages=2, kv_stages=3, fwd_tma=False, dq_tma=True, kv_tma=False,
                      kv_overlap=True, fwd_exp2=True, dq_exp2=True, kv_exp2=True, dq_rsum_mma=True,
                      source="h200 tune 2026-12-02 (--dims=64, each kernel alone); repeated 2026-12-03; TMA "
                             "2026-12-03; overlap 2026-12-03; exp2 and forward tile 2026-12-04; GProj row sum "
                             "2026-12-04"),
    # d = 64, causal: outputs/kernels/h200/triton_fa2_tune_d64_2026-12-03.json (N = 8192, each kernel
    # alone): forward 64 x 64 / 4 warps / 3 stages 0.910 ms (the entry it replaces, 128 x 64 / 8 warps /
    # 2 stages, 0.995 ms), dQ kernel 64 x 128 / 4 warps / 2 stages 1.041 ms (64 x 64: 1.180 ms at 2
    # stages, 1.063 ms at 3), dK/dV kernel 64 x 64 / 4 warps / 2 stages 1.524 ms (unchanged). TMA (the r5
    # sweep above): forward 0.934 -> 0.895 ms (on), dQ 1.133 -> 1.196 and dK/dV 1.521 -> 1.567 (off).
    (64, True): dict(fwd_m=64, fwd_n=64, dq_m=64, dq_n=128, kv_n=64, kv_m=64, num_warps=4, fwd_warps=4,
                     fwd_stages=3, dq_warps=4, dq_stages=2, kv_warps=4, kv_stages=2, bwd_stages=2,
                     fwd_tma=True, dq_tma=False, kv_tma=True, kv_overlap=True, fwd_exp2=True, dq_exp2=True,
                     kv_exp2=False,
                     source="h200 tune 2026-12-03 (--dims=64 --causal=1, each kernel alone); TMA 2026-12-03; "
                            "overlap 2026-12-03; exp2 2026-12-04"),
}
# Warps and stages of the backward kernels per GProj mode, over TUNED_CONFIGS' (same tiles: GProj
# never gets tiles of its own, so GProj on and off differ by the GProj arithmetic alone), and their TMA and
# overlap switches. Keys (head_dim, causal, gproj); values only LAUNCH_FIELDS and SCHEDULE_FIELDS.
# d = 64 non-causal, the sweep above: the GProj dQ kernel at 4 warps / 3 stages (2.612 ms against the
# GProj-off dQ kernel's 1.64 ms; why GProj costs so much more at d = 64 than at d = 128 was not measured).
# d = 64 causal, the 2026-12-03 sweep: GProj's dQ kernel fastest at the GProj-off launch (1.512 ms against
# 1.041 ms), GProj's dK/dV kernel (under "dq_dk") at 4 warps / 3 stages (2.061 ms against 1.524 ms).
# TMA and overlap (every entry): triton_fa2_tune_overlap_r5_2026-12-03.json, each GProj kernel at its launch
# above with the four TMA x overlap settings, 5 alternating rounds (median ms, the GProj-off table's switches ->
# the choice). The dQ kernel under "dq" (also "dq_dk"'s): d = 128 non-causal 3.892 -> 3.739, causal 2.349 -> 2.163;
# d = 64 non-causal 2.530 -> 2.364, causal 1.408 -> 1.391 (3 of 5 rounds faster; TMA and overlap on everywhere).
# The dK/dV kernel under "dq_dk": d = 128 non-causal 5.745 -> 4.907 (on, on), causal 3.299 -> 2.826 (tma off,
# overlap on); d = 64 non-causal 3.591 -> 3.346 (on, on), causal 1.871 -> 1.787 (off, on).
# GProj's warps and stages again with those switches on: triton_fa2_tune_gproj_launch_r3_2026-12-03.json (--parts=
# dq_gproj,kv_gproj --rounds=3 at ffa01b7; median of 3 rounds, ms at (warps, stages)): every earlier choice kept
# (d = 128 at GProj off's 4 / 2: dQ 3.609 non-causal, 2.117 causal; d = 64 dQ 4 / 3: 2.297 non-causal; dK/dV 4 / 3:
# 3.349 non-causal, 2.009 causal) and one new: the d = 64 causal dQ kernel at 4 / 3, 1.289 ms against 1.391 at GProj
# off's 4 / 2.
TUNED_GPROJ_LAUNCH: dict[tuple[int, bool, str], dict] = {
    (64, False, "dq"): dict(dq_warps=4, dq_stages=3, dq_tma=True, dq_overlap=True),
    (64, False, "dq_dk"): dict(dq_warps=4, dq_stages=3, dq_tma=True, dq_overlap=True, kv_tma=True, kv_overlap=True),
    (64, True, "dq"): dict(dq_warps=4, dq_stages=3, dq_tma=True, dq_overlap=True),
    (64, True, "dq_dk"): dict(dq_warps=4, dq_stages=3, kv_warps=4, kv_stages=3, dq_tma=True, dq_overlap=True,
                              kv_tma=False, kv_overlap=True),
    (128, False, "dq"): dict(dq_tma=True, dq_overlap=True),
    (128, False, "dq_dk"): dict(dq_tma=True, dq_overlap=True, kv_tma=True, kv_overlap=True),
    (128, True, "dq"): dict(dq_tma=True, dq_overlap=True),
    (128, True, "dq_dk"): dict(dq_tma=True, dq_overlap=True, kv_tma=False, kv_overlap=True),
}
# The FP32 backward's own backward tiles/warps/stages per (head_dim, causal) (BlockConfig fields of
# the dQ and dK/dV kernels); where absent, TUNED_CONFIGS' backward tiles halved (see default_config).
TUNED_FP32_BWD: dict[tuple[int, bool], dict] = {}


def default_config(head_dim: int, fp32_backward: bool = False, causal: bool = False,
                   gproj: str = "off", fp32_dot: str = "ieee") -> BlockConfig:
    """The H200 choice (see the module docstring): no autotuning, so runs are reproducible.
    ``TUNED_CONFIGS[(head_dim, causal)]`` where the table has the head dim, with GProj's own
    warps/stages from ``TUNED_GPROJ_LAUNCH``; otherwise the untuned fallback (128 x 64 tiles, 4
    warps for d <= 64 and 8 above). The FP32 backward halves the backward tiles of either, except with
    ``fp32_dot="bf16x3"``: its dots read the same bf16 K, Q, dO tiles from shared memory as the bf16
    kernel (the fp32 pieces are register operands), so it keeps the bf16 kernel's configuration. Every FP32
    backward computes its exponentials with exp (``dq_exp2``/``kv_exp2`` off) unless its own entry says otherwise."""
    _check_fp32_dot(fp32_dot)
    entry = TUNED_CONFIGS.get((int(head_dim), bool(causal)))
    if entry is None:
        warps = 4 if head_dim <= 64 else 8
        cfg = BlockConfig(num_warps=warps)
    else:
        fields = {key: value for key, value in entry.items() if key != "source"}
        fields.update(TUNED_GPROJ_LAUNCH.get((int(head_dim), bool(causal), gproj), {}))
        cfg = BlockConfig(**fields)
    fp32_entry = (TUNED_FP32_BWD.get((int(head_dim), bool(causal)))
                  if fp32_backward and fp32_dot != "bf16x3" else None)
    # the overlap switches were timed on the bf16 kernels; with fp32 operands (ieee, tf32x3) kv_overlap made the
    # FP32 backward 1.5-1.9x slower on the H200 (the 2026-12-03 overlap bench files), so it keeps the default order
    # there unless its own entry says otherwise (the same bits either way)
    no_overlap = dict(dq_overlap=False, kv_overlap=False)
    # exp2 was timed on the bf16 kernels too: the FP32 backward (every fp32_dot) computes its exponentials with
    # exp unless its own entry says otherwise (module docstring, "exp2")
    keep_exp = dict(dq_exp2=False, kv_exp2=False)
    if fp32_backward and fp32_dot == "bf16x3":
        return dataclasses.replace(cfg, **keep_exp)
    if fp32_entry is not None:
        own = {key: value for key, value in fp32_entry.items() if key != "source"}
        return dataclasses.replace(cfg, **{**no_overlap, **keep_exp, **own})
    if fp32_backward and fp32_dot != "bf16x3":
        # fp32 operands take twice the shared memory: halve the backward tiles (never below 16),
        # one pipeline stage, the shared warps for both backward kernels
        return dataclasses.replace(cfg, dq_m=max(16, min(cfg.dq_m, 64)), dq_n=max(16, min(cfg.dq_n, 64) // 2),
                                   kv_n=max(16, min(cfg.kv_n, 64)), kv_m=max(16, min(cfg.kv_m, 64) // 2),
                                   bwd_stages=1, dq_warps=None, kv_warps=None, dq_stages=None, kv_stages=None,
                                   **no_overlap, **keep_exp)
    return cfg


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device=None) -> str | None:
    """None when the kernels can run on ``device`` (default: CUDA if present, else the CPU
    interpreter); otherwise one sentence saying why not."""
    if triton is None:
        return f"triton is not importable ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR})"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if _interpreting():
            return ("TRITON_INTERPRET is set: the kernels were built for the CPU interpreter, "
                    "which takes CPU tensors")
        if not torch.cuda.is_available():
            return "no CUDA device is visible to torch"
        major, _ = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"the kernel needs compute capability >= 8.0 (bf16 tensor cores), got {major}.x"
        return None
    if device.type == "cpu":
        if not _interpreting():
            return ("no CUDA device, and TRITON_INTERPRET=1 was not set before triton was imported "
                    "(the CPU interpreter is the only way to run Triton kernels without a GPU)")
        if not _KERNELS_INTERPRETED:
            return ("TRITON_INTERPRET=1 is set but this module was imported before it was: "
                    "the kernels were compiled for the GPU")
        return None
    return f"device type {device.type!r} is not supported (CUDA, or CPU through TRITON_INTERPRET=1)"


# ---------------------------------------------------------------------------------------------
# Kernels. Every tensor is contiguous (batch * heads, N, d); a program's ``bh`` picks the head.
# ---------------------------------------------------------------------------------------------
if triton is not None:

    # columns of the ones operand that gives GProj's row sum as a product (tl.dot's smallest width)
    RSUM_COLS = tl.constexpr(16)

    # -- masked and unmasked loads/stores: the masks are compile-time choices (constexpr), and a
    #    load that drops them reads the same values, so the arithmetic does not change --
    @triton.jit
    def _load_tile(ptrs, rows_ok, d_ok, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
        if MASK_ROWS:
            if MASK_D:
                x = tl.load(ptrs, mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            if MASK_D:
                x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
            else:
                x = tl.load(ptrs)
        return x

    @triton.jit
    def _load_inner(ptrs, desc, row, rows_ok, d_ok, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr,
                    TMA: tl.constexpr):
        """An inner-loop tile (rows ``row ..`` of the [B*H*N, d] view): through the tensor descriptor
        ``desc`` when ``TMA`` and the load needs no mask, else ``_load_tile``'s pointer load. Both read the
        same values; a masked load never goes through the descriptor, whose rows past this head's N would
        be the next head's, not zeros."""
        if TMA and not MASK_ROWS and not MASK_D:
            x = desc.load([row, 0])
        else:
            x = _load_tile(ptrs, rows_ok, d_ok, MASK_ROWS, MASK_D)
        return x

    @triton.jit
    def _query_block(HEAVY_FIRST: tl.constexpr):
        """The query block a query-outer program owns: its grid index, or counted from the last block when
        ``HEAVY_FIRST`` (causal: the last blocks see the most keys, so they start first)."""
        pid = tl.program_id(0)
        if HEAVY_FIRST:
            pid = tl.num_programs(0) - 1 - pid
        return pid

    @triton.jit
    def _store_tile(ptrs, x, rows_ok, d_ok, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
        if MASK_ROWS:
            if MASK_D:
                tl.store(ptrs, x, mask=rows_ok[:, None] & d_ok[None, :])
            else:
                tl.store(ptrs, x, mask=rows_ok[:, None])
        else:
            if MASK_D:
                tl.store(ptrs, x, mask=d_ok[None, :])
            else:
                tl.store(ptrs, x)

    @triton.jit
    def _load_rowvec(ptrs, rows_ok, other, MASK_ROWS: tl.constexpr):
        if MASK_ROWS:
            x = tl.load(ptrs, mask=rows_ok, other=other)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def _split3(a, DTYPE: tl.constexpr):
        """fp32 ``a`` as ``(hi, mid, lo)`` in ``DTYPE`` (bf16): ``hi = bf16(a)``, ``mid = bf16(a - hi)``,
        ``lo = bf16(a - hi - mid)``. Both differences are exact in fp32 and the three 8-bit pieces hold
        all 24 of fp32's significand bits, so ``hi + mid + lo == a`` exactly wherever the pieces stay
        normal: bf16 has fp32's exponent range, and lo's last bit is a's (2^-23 |a| at most), so for
        |a| >= 2^-103."""
        hi = a.to(DTYPE)
        rest = a - hi.to(tl.float32)
        mid = rest.to(DTYPE)
        lo = (rest - mid.to(tl.float32)).to(DTYPE)
        return hi, mid, lo

    @triton.jit
    def _dot_f32(a, b, acc, F32_DOT: tl.constexpr):
        """``acc + a @ b`` for an fp32 ``a`` (P or dS) and an input-format ``b`` (K, Q or dO), the dots of
        the FP32 backward. ``"ieee"``/``"tf32x3"``: one fp32 dot of ``a`` with ``b`` upcast exactly.
        ``"bf16x3"`` (b in bf16 only): ``a = hi + mid + lo`` exactly (``_split3``), and each bf16 x bf16
        product is exact in the tensor core's fp32 accumulator: three bf16 dots, smallest piece first."""
        if F32_DOT == "bf16x3":
            hi, mid, lo = _split3(a, b.dtype)
            acc = tl.dot(lo, b, acc, input_precision="ieee")
            acc = tl.dot(mid, b, acc, input_precision="ieee")
            acc = tl.dot(hi, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision=F32_DOT)
        return acc

    @triton.jit
    def _split3_kernel(X, HI, MID, LO, n, BLOCK: tl.constexpr):
        """The split of ``_dot_f32``'s ``"bf16x3"`` alone, for the tests: x -> (hi, mid, lo) in bf16."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(X + offs, mask=ok, other=0.0)
        hi, mid, lo = _split3(x, tl.bfloat16)
        tl.store(HI + offs, hi, mask=ok)
        tl.store(MID + offs, mid, mask=ok)
        tl.store(LO + offs, lo, mask=ok)

    @triton.jit
    def _dot_f32_tile_kernel(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, F32_DOT: tl.constexpr):
        """One ``_dot_f32`` alone, for the tests: C (M x N, fp32) = A (M x K, fp32) @ B (K x N, input format)."""
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(A + rm[:, None] * K + rk[None, :])
        b = tl.load(B + rk[:, None] * N + rn[None, :])
        c = _dot_f32(a, b, tl.zeros([M, N], dtype=tl.float32), F32_DOT)
        tl.store(C + rm[:, None] * N + rn[None, :], c)

    @triton.jit
    def _exp_scale(scale, EXP2: tl.constexpr):
        """The scale the exponentials' arguments are multiplied by: ``scale``, or under EXP2 the fp32 product
        ``scale * log2 e`` (log2 e = 1.4426950408889634, rounded to fp32; the product rounded once)."""
        if EXP2:
            scale = scale * 1.4426950408889634
        return scale

    @triton.jit
    def _exp_scaled(x, EXP2: tl.constexpr):
        """``exp(x)``, or under EXP2 ``exp2(x)`` for an ``x`` already scaled by log2 e (``_exp_scale``)."""
        if EXP2:
            y = tl.exp2(x)
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def _fwd_blocks(acc, l_i, m_i, q, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N, D_HEAD, scale, lo, hi,
                    MASK_CAUSAL: tl.constexpr, MASK_COLS: tl.constexpr, MASK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, TMA: tl.constexpr, EXP2: tl.constexpr):
        """Key blocks [lo, hi) of one query block, in increasing order (Alg. 1's inner loop).
        MASK_CAUSAL / MASK_COLS: apply the causal mask / the bounds mask (keys >= N) to S.
        TMA: the K, V tiles whose loads need no mask through the descriptors KD, VD (``_load_inner``).
        EXP2: ``scale`` is the exponent's scale times log2 e and the exponentials are exp2 (``_exp_scaled``)."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < N
            k = _load_inner(K + base + offs_n[:, None] * D_HEAD + offs_d[None, :], KD, tma_row + start_n, col_ok, d_ok,
                            MASK_COLS, MASK_D, TMA)
            v = _load_inner(V + base + offs_n[:, None] * D_HEAD + offs_d[None, :], VD, tma_row + start_n, col_ok, d_ok,
                            MASK_COLS, MASK_D, TMA)

            # -- compute qk: raw scores, fp32 accumulation --
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            if MASK_COLS:
                keep = col_ok[None, :]
                if MASK_CAUSAL:
                    keep = keep & (offs_n[None, :] <= offs_m[:, None])
                s = tl.where(keep, s, float("-inf"))
            elif MASK_CAUSAL:
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))

            # -- online softmax: new max, then subtract the max first and scale second --
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = _exp_scaled((s - m_new[:, None]) * scale, EXP2)
            alpha = _exp_scaled((m_i - m_new) * scale, EXP2)
            # -- row sum from p before rounding, in fp32 --
            l_i = alpha * l_i + tl.sum(p, 1)

            # -- P rounded to the input format, then acc = alpha * acc + P~ V (fp32 accumulator) --
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _fwd_kernel(Q, K, V, KD, VD, O, LSE, N, D_HEAD, scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                    SPLIT: tl.constexpr, TMA: tl.constexpr, HEAVY_FIRST: tl.constexpr, EXP2: tl.constexpr):
        # KD, VD: tensor descriptors of K, V over their [B*H*N, d] view when TMA, else None (unused)
        start_m = _query_block(HEAVY_FIRST) * BLOCK_M
        bh = tl.program_id(1)
        base = bh.to(tl.int64) * N * D_HEAD
        tma_row = bh * N  # this head's first row in the descriptors' view (B*H*N < 2^31, checked on the host)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < N
        d_ok = offs_d < D_HEAD
        q = _load_tile(Q + base + offs_m[:, None] * D_HEAD + offs_d[None, :], row_ok, d_ok, not EVEN_N, not EVEN_D)

        # -- running statistics: row max m (raw-score units), row sum l, accumulator; all fp32 --
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        escale = _exp_scale(scale, EXP2)

        # causal: key blocks wholly above the diagonal are skipped
        hi = N
        if CAUSAL:
            hi = tl.minimum(N, start_m + BLOCK_M)
        if SPLIT:
            # the same key blocks in the same order, split where the masks start to matter: blocks
            # wholly below the diagonal (causal) or wholly inside [0, N) (not causal) need no mask
            if CAUSAL:
                mid = (start_m // BLOCK_N) * BLOCK_N
            else:
                mid = (N // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N, D_HEAD,
                                        escale, 0, mid, False, False, not EVEN_D, BLOCK_N, TMA, EXP2)
            if CAUSAL:
                acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N,
                                            D_HEAD, escale, mid, hi, True, not EVEN_N, not EVEN_D, BLOCK_N, TMA,
                                            EXP2)
            elif not EVEN_N:
                acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N,
                                            D_HEAD, escale, mid, hi, False, True, not EVEN_D, BLOCK_N, TMA,
                                            EXP2)
        else:
            # reference path: every block masked (the test of SPLIT / EVEN_N compares against it)
            acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N, D_HEAD,
                                        escale, 0, hi, CAUSAL, True, True, BLOCK_N, TMA, EXP2)

        # -- epilogue: normalise once, round the output once, store the natural-log LSE in fp32 --
        out = acc / l_i[:, None]
        _store_tile(O + base + offs_m[:, None] * D_HEAD + offs_d[None, :], out.to(O.dtype.element_ty), row_ok, d_ok,
                    not EVEN_N, not EVEN_D)
        lse = m_i * scale + tl.log(l_i)
        if EVEN_N:
            tl.store(LSE + bh.to(tl.int64) * N + offs_m, lse)
        else:
            tl.store(LSE + bh.to(tl.int64) * N + offs_m, lse, mask=row_ok)

    @triton.jit
    def _bwd_preprocess_kernel(O, DO, DELTA, N, D_HEAD, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        base = bh.to(tl.int64) * N * D_HEAD
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m < N)[:, None] & (offs_d < D_HEAD)[None, :]
        o = tl.load(O + base + offs_m[:, None] * D_HEAD + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(DO + base + offs_m[:, None] * D_HEAD + offs_d[None, :], mask=mask, other=0.0)
        # -- D_i = rowsum(dO * O) in fp32, from the stored (rounded) output --
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DELTA + bh.to(tl.int64) * N + offs_m, delta, mask=offs_m < N)

    @triton.jit
    def _dq_blocks(dq, r, pk, q, do, lse, delta, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N, D_HEAD, scale,
                   lo, hi, MASK_CAUSAL: tl.constexpr, MASK_COLS: tl.constexpr, MASK_D: tl.constexpr,
                   GPROJ: tl.constexpr, FP32_BWD: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                   TMA: tl.constexpr, OVERLAP: tl.constexpr, EXP2: tl.constexpr, RSUM_MMA: tl.constexpr):
        """Key blocks [lo, hi) of the dQ kernel's query block, in increasing order (Alg. 2 for dQ).
        TMA: the K, V tiles whose loads need no mask through the descriptors KD, VD, as in ``_fwd_blocks``.
        EXP2: ``scale`` and ``lse`` come multiplied by log2 e, and P = exp2(S scale - lse) (``_exp_scaled``).
        RSUM_MMA: GProj's r is a [BLOCK_M, RSUM_COLS] accumulator whose first column gathers dS~ times a column of
        ones on the tensor cores (module docstring, "GProj's row sum"); else r is [BLOCK_M], summed in registers."""
        if RSUM_MMA:
            # a [BLOCK_N, RSUM_COLS] operand of the input format: ones in its first column, zeros elsewhere
            col = tl.arange(0, RSUM_COLS)[None, :] + tl.zeros([BLOCK_N, RSUM_COLS], dtype=tl.int32)
            ones = tl.where(col == 0, 1.0, 0.0).to(K.dtype.element_ty)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < N
            k = _load_inner(K + base + offs_n[:, None] * D_HEAD + offs_d[None, :], KD, tma_row + start_n, col_ok, d_ok,
                            MASK_COLS, MASK_D, TMA)
            v = _load_inner(V + base + offs_n[:, None] * D_HEAD + offs_d[None, :], VD, tma_row + start_n, col_ok, d_ok,
                            MASK_COLS, MASK_D, TMA)

            # -- recompute S and P from the stored log-sum-exp --
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            p = _exp_scaled(s * scale - lse[:, None], EXP2)
            if MASK_COLS:
                keep = col_ok[None, :]
                if MASK_CAUSAL:
                    keep = keep & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(keep, p, 0.0)
            elif MASK_CAUSAL:
                p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)

            # -- dP = dO V^T and dS = P * (dP - D), fp32 --
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            if GPROJ != 0 and OVERLAP:
                # -- GProj's (P~ K)_i += P~ K_j issued before dS's elementwise work, which then runs while the
                #    product is on the tensor cores (the same accumulator and order: the same bits) --
                pk = _gproj_pk(p, k, pk, FP32_BWD, F32_DOT)
            ds = p * (dp - delta[:, None])

            if FP32_BWD:
                # -- FP32 backward: dS stays fp32 (F32_DOT: ieee, tf32x3 or bf16x3; _dot_f32) --
                dq = _dot_f32(ds, k, dq, F32_DOT)
            else:
                # -- dS rounded to the input format: seed 004, cause 2 --
                ds_lo = ds.to(k.dtype)
                dq = tl.dot(ds_lo, k, dq, input_precision="ieee")
            if GPROJ != 0:
                # -- GProj: r_i += sum_j dS~_ij (of the values the matmul saw), (P~ K)_i += P~ K_j --
                if FP32_BWD:
                    r += tl.sum(ds, 1)
                elif RSUM_MMA:
                    r = tl.dot(ds_lo, ones, r, input_precision="ieee")
                else:
                    r += tl.sum(ds_lo.to(tl.float32), 1)
                if not OVERLAP:
                    pk = _gproj_pk(p, k, pk, FP32_BWD, F32_DOT)
        return dq, r, pk

    @triton.jit
    def _gproj_pk(p, k, pk, FP32_BWD: tl.constexpr, F32_DOT: tl.constexpr):
        """GProj's ``pk += P~ K_j`` of one key block (P rounded to the input format; fp32 under FP32_BWD)."""
        if FP32_BWD:
            pk = _dot_f32(p, k, pk, F32_DOT)
        else:
            pk = tl.dot(p.to(k.dtype), k, pk, input_precision="ieee")
        return pk

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, KD, VD, DO, LSE, DELTA, DQ, R, N, D_HEAD, scale,
                       CAUSAL: tl.constexpr, GPROJ: tl.constexpr, FP32_BWD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, SPLIT: tl.constexpr,
                       F32_DOT: tl.constexpr, TMA: tl.constexpr, HEAVY_FIRST: tl.constexpr,
                       OVERLAP: tl.constexpr, EXP2: tl.constexpr, RSUM_MMA: tl.constexpr):
        # KD, VD: as in the forward (descriptors of K, V when TMA, else None)
        start_m = _query_block(HEAVY_FIRST) * BLOCK_M
        bh = tl.program_id(1)
        base = bh.to(tl.int64) * N * D_HEAD
        row_base = bh.to(tl.int64) * N
        tma_row = bh * N
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < N
        d_ok = offs_d < D_HEAD
        q = _load_tile(Q + base + offs_m[:, None] * D_HEAD + offs_d[None, :], row_ok, d_ok, not EVEN_N, not EVEN_D)
        do = _load_tile(DO + base + offs_m[:, None] * D_HEAD + offs_d[None, :], row_ok, d_ok, not EVEN_N,
                        not EVEN_D)
        # padded rows get lse = +inf, so their P is exactly 0
        lse = _load_rowvec(LSE + row_base + offs_m, row_ok, float("inf"), not EVEN_N)
        delta = _load_rowvec(DELTA + row_base + offs_m, row_ok, 0.0, not EVEN_N)
        escale = _exp_scale(scale, EXP2)
        lse = _exp_scale(lse, EXP2)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # -- GProj: r_i and (P~ K)_i accumulated beside dQ, fp32 (unused, and compiled away, when off) --
        if RSUM_MMA:
            r = tl.zeros([BLOCK_M, RSUM_COLS], dtype=tl.float32)
        else:
            r = tl.zeros([BLOCK_M], dtype=tl.float32)
        pk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        hi = N
        if CAUSAL:
            hi = tl.minimum(N, start_m + BLOCK_M)
        if SPLIT:
            # as in the forward: unmasked blocks first, then the diagonal (causal) or the tail (N % BLOCK_N)
            if CAUSAL:
                mid = (start_m // BLOCK_N) * BLOCK_N
            else:
                mid = (N // BLOCK_N) * BLOCK_N
            dq, r, pk = _dq_blocks(dq, r, pk, q, do, lse, delta, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N,
                                   D_HEAD, escale, 0, mid, False, False, not EVEN_D, GPROJ, FP32_BWD, F32_DOT, BLOCK_N,
                                   TMA, OVERLAP, EXP2, RSUM_MMA)
            if CAUSAL:
                dq, r, pk = _dq_blocks(dq, r, pk, q, do, lse, delta, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok,
                                       N, D_HEAD, escale, mid, hi, True, not EVEN_N, not EVEN_D, GPROJ, FP32_BWD,
                                       F32_DOT, BLOCK_N, TMA, OVERLAP, EXP2, RSUM_MMA)
            elif not EVEN_N:
                dq, r, pk = _dq_blocks(dq, r, pk, q, do, lse, delta, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok,
                                       N, D_HEAD, escale, mid, hi, False, True, not EVEN_D, GPROJ, FP32_BWD, F32_DOT,
                                       BLOCK_N, TMA, OVERLAP, EXP2, RSUM_MMA)
        else:
            dq, r, pk = _dq_blocks(dq, r, pk, q, do, lse, delta, K, V, KD, VD, tma_row, base, offs_m, offs_d, d_ok, N,
                                   D_HEAD, escale, 0, hi, CAUSAL, True, True, GPROJ, FP32_BWD, F32_DOT, BLOCK_N, TMA,
                                   OVERLAP, EXP2, RSUM_MMA)

        if RSUM_MMA:
            # -- r_i: the first column of the product (the others are exact zeros, masked off all the same) --
            r = tl.sum(tl.where(tl.arange(0, RSUM_COLS)[None, :] == 0, r, 0.0), 1)
        if GPROJ != 0:
            # -- GProj: dQ_i -= r_i (P~ K)_i once every key block has been seen --
            dq = dq - r[:, None] * pk
        if GPROJ == 2:
            # -- GProj dq_dk: hand r to the dK/dV kernel, which runs next --
            if EVEN_N:
                tl.store(R + row_base + offs_m, r)
            else:
                tl.store(R + row_base + offs_m, r, mask=row_ok)
        dq = dq * scale
        _store_tile(DQ + base + offs_m[:, None] * D_HEAD + offs_d[None, :], dq.to(DQ.dtype.element_ty), row_ok,
                    d_ok, not EVEN_N, not EVEN_D)

    @triton.jit
    def _kv_blocks(dk, dv, k, v, Q, DO, QD, DOD, tma_row, LSE, DELTA, R, base, row_base, offs_n, offs_d, d_ok, N,
                   D_HEAD, scale, lo, hi, MASK_CAUSAL: tl.constexpr, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr,
                   GPROJ: tl.constexpr, FP32_BWD: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                   TMA: tl.constexpr, OVERLAP: tl.constexpr, EXP2: tl.constexpr):
        """Query blocks [lo, hi) of the dK/dV kernel's key block, in increasing order (Alg. 2 for dK, dV).
        TMA: the Q, dO tiles whose loads need no mask through the descriptors QD, DOD (``_load_inner``).
        EXP2: ``scale`` comes multiplied by log2 e, each lse is, and P = exp2(S scale - lse) (``_exp_scaled``)."""
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < N
            q = _load_inner(Q + base + offs_m[:, None] * D_HEAD + offs_d[None, :], QD, tma_row + start_m, row_ok, d_ok,
                            MASK_ROWS, MASK_D, TMA)
            do = _load_inner(DO + base + offs_m[:, None] * D_HEAD + offs_d[None, :], DOD, tma_row + start_m, row_ok,
                             d_ok, MASK_ROWS, MASK_D, TMA)
            lse = _load_rowvec(LSE + row_base + offs_m, row_ok, float("inf"), MASK_ROWS)
            delta = _load_rowvec(DELTA + row_base + offs_m, row_ok, 0.0, MASK_ROWS)

            # -- recompute S^T and P^T from the stored log-sum-exp --
            s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
            p_t = _exp_scaled(s_t * scale - _exp_scale(lse, EXP2)[None, :], EXP2)
            if MASK_CAUSAL:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)

            # -- dV_j += P~^T dO (P rounded to the input format; fp32 under FP32_BWD) --
            if FP32_BWD:
                p_mm = p_t
            else:
                p_mm = p_t.to(do.dtype)
            if not OVERLAP:
                dv = _dv_step(p_mm, do, dv, FP32_BWD, F32_DOT)

            # -- dP^T = V dO^T and dS^T = P^T * (dP^T - D), fp32 --
            dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
            if OVERLAP:
                # -- dV's product issued after dP^T's, so that it runs on the tensor cores while dS^T's
                #    elementwise work does (dV's own accumulator and order: the same bits) --
                dv = _dv_step(p_mm, do, dv, FP32_BWD, F32_DOT)
            ds_t = p_t * (dp_t - delta[None, :])

            # -- dK_j += dS~^T Q --
            if FP32_BWD:
                dk = _dot_f32(ds_t, q, dk, F32_DOT)
            else:
                # -- dS rounded to the input format: seed 004, cause 2 --
                ds_lo = ds_t.to(q.dtype)
                dk = tl.dot(ds_lo, q, dk, input_precision="ieee")
            if GPROJ == 2:
                # -- GProj dq_dk: dK's operand is dS~ - round(r_i P~_ij); the correction is a second
                #    operand of the fp32 accumulator, so the difference itself is never rounded --
                r = _load_rowvec(R + row_base + offs_m, row_ok, 0.0, MASK_ROWS)
                if FP32_BWD:
                    dk = _dot_f32(-(r[None, :] * p_mm), q, dk, F32_DOT)
                else:
                    corr = (r[None, :] * p_mm.to(tl.float32)).to(q.dtype)
                    dk = tl.dot(-corr, q, dk, input_precision="ieee")
        return dk, dv

    @triton.jit
    def _dv_step(p_mm, do, dv, FP32_BWD: tl.constexpr, F32_DOT: tl.constexpr):
        """``dv += P~^T dO`` of one query block."""
        if FP32_BWD:
            dv = _dot_f32(p_mm, do, dv, F32_DOT)
        else:
            dv = tl.dot(p_mm, do, dv, input_precision="ieee")
        return dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, QD, DOD, DO, LSE, DELTA, R, DK, DV, N, D_HEAD, scale,
                         CAUSAL: tl.constexpr, GPROJ: tl.constexpr, FP32_BWD: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, SPLIT: tl.constexpr,
                         F32_DOT: tl.constexpr, TMA: tl.constexpr, OVERLAP: tl.constexpr, EXP2: tl.constexpr):
        # key-block outer: this program owns keys [start_n, start_n + BLOCK_N); tiles are transposed
        # (keys x query rows) so that dK and dV accumulate as plain row-major products.
        # QD, DOD: tensor descriptors of Q, dO over their [B*H*N, d] view when TMA, else None (unused)
        start_n = tl.program_id(0) * BLOCK_N
        bh = tl.program_id(1)
        base = bh.to(tl.int64) * N * D_HEAD
        row_base = bh.to(tl.int64) * N
        tma_row = bh * N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        col_ok = offs_n < N
        d_ok = offs_d < D_HEAD
        k = _load_tile(K + base + offs_n[:, None] * D_HEAD + offs_d[None, :], col_ok, d_ok, not EVEN_N, not EVEN_D)
        v = _load_tile(V + base + offs_n[:, None] * D_HEAD + offs_d[None, :], col_ok, d_ok, not EVEN_N, not EVEN_D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        escale = _exp_scale(scale, EXP2)

        lo = 0
        if CAUSAL:
            lo = (start_n // BLOCK_M) * BLOCK_M  # query rows above the first key never see it
        if SPLIT:
            # the same query blocks in the same order: the diagonal ones (causal; the first query
            # block whose first row is past this block's last key is unmasked), then the unmasked
            # ones, then the tail (N % BLOCK_M, bounds mask only)
            full = (N // BLOCK_M) * BLOCK_M
            mid = lo
            if CAUSAL:
                mid = tl.minimum(N, tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M)
                dk, dv = _kv_blocks(dk, dv, k, v, Q, DO, QD, DOD, tma_row, LSE, DELTA, R, base, row_base, offs_n,
                                    offs_d, d_ok, N, D_HEAD, escale, lo, mid, True, not EVEN_N, not EVEN_D, GPROJ,
                                    FP32_BWD, F32_DOT, BLOCK_M, TMA, OVERLAP, EXP2)
            if EVEN_N:
                dk, dv = _kv_blocks(dk, dv, k, v, Q, DO, QD, DOD, tma_row, LSE, DELTA, R, base, row_base, offs_n,
                                    offs_d, d_ok, N, D_HEAD, escale, mid, N, False, False, not EVEN_D, GPROJ, FP32_BWD,
                                    F32_DOT, BLOCK_M, TMA, OVERLAP, EXP2)
            else:
                dk, dv = _kv_blocks(dk, dv, k, v, Q, DO, QD, DOD, tma_row, LSE, DELTA, R, base, row_base, offs_n,
                                    offs_d, d_ok, N, D_HEAD, escale, mid, full, False, False, not EVEN_D, GPROJ,
                                    FP32_BWD, F32_DOT, BLOCK_M, TMA, OVERLAP, EXP2)
                dk, dv = _kv_blocks(dk, dv, k, v, Q, DO, QD, DOD, tma_row, LSE, DELTA, R, base, row_base, offs_n,
                                    offs_d, d_ok, N, D_HEAD, escale, tl.maximum(mid, full), N, False, True, not EVEN_D,
                                    GPROJ, FP32_BWD, F32_DOT, BLOCK_M, TMA, OVERLAP, EXP2)
        else:
            dk, dv = _kv_blocks(dk, dv, k, v, Q, DO, QD, DOD, tma_row, LSE, DELTA, R, base, row_base, offs_n, offs_d,
                                d_ok, N, D_HEAD, escale, lo, N, CAUSAL, True, True, GPROJ, FP32_BWD, F32_DOT, BLOCK_M,
                                TMA, OVERLAP, EXP2)

        dk = dk * scale
        _store_tile(DK + base + offs_n[:, None] * D_HEAD + offs_d[None, :], dk.to(DK.dtype.element_ty), col_ok, d_ok,
                    not EVEN_N, not EVEN_D)
        _store_tile(DV + base + offs_n[:, None] * D_HEAD + offs_d[None, :], dv.to(DV.dtype.element_ty), col_ok, d_ok,
                    not EVEN_N, not EVEN_D)

    # jit() decides at decoration time whether a kernel runs in the interpreter
    _KERNELS_INTERPRETED = not isinstance(_fwd_kernel, triton.runtime.JITFunction)

    def _fix_interpreter_index():
        """Triton 3.6's CPU interpreter holds scalars as 1-element numpy arrays and converts a loop
        bound with ``int(array)``, which NumPy >= 2.3 refuses for arrays of ndim > 0, so any ``range()``
        over a runtime value fails there. Convert through the single element instead; interpreter only."""
        import numpy as np
        from triton.runtime import interpreter as interp
        try:
            int(np.zeros(1, dtype=np.int32))
            return
        except TypeError:
            pass
        original = interp._patch_lang_tensor
        if getattr(original, "_attnum_fixed", False):
            return

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._attnum_fixed = True
        interp._patch_lang_tensor = patched

    if _KERNELS_INTERPRETED:
        _fix_interpreter_index()
else:  # pragma: no cover
    _KERNELS_INTERPRETED = False


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
def _check(q, k, v, causal: bool, scale):
    reason = unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(f"triton_fa2 cannot run: {reason}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all have shape (batch, heads, N, d); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (n_q == n_k and d_v == d are required; "
                         f"{'causal masking is top-left aligned and needs n_q == n_k' if causal else ''})")
    if 0 in q.shape:
        raise ValueError(f"empty size in q {tuple(q.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > 256:
        raise ValueError(f"head_dim <= 256 is supported, got {q.shape[-1]}")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return scale


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


FP32_DOTS = ("ieee", "tf32x3", "bf16x3")


def _check_fp32_dot(fp32_dot: str, dtype: torch.dtype | None = None) -> None:
    """``fp32_dot`` is one of ``FP32_DOTS``; with ``dtype`` (the bf16-side operands' dtype, where the FP32
    backward's dots will run), ``"bf16x3"`` needs bf16 there (its pieces sit beside bf16 operands)."""
    if fp32_dot not in FP32_DOTS:
        raise ValueError(f"fp32_dot must be one of {FP32_DOTS}, got {fp32_dot!r}")
    if dtype is not None and fp32_dot == "bf16x3" and dtype != torch.bfloat16:
        raise ValueError(f"fp32_dot='bf16x3' splits fp32 values into bf16 pieces beside bf16 operands and needs "
                         f"bf16 inputs; got {dtype} (use 'ieee' or 'tf32x3')")


def _even(n: int, *blocks: int) -> bool:
    return all(n % block == 0 for block in blocks)


def _tma_refusal(*tensors: torch.Tensor) -> str | None:
    """Why the contiguous (B, H, N, d) ``tensors`` cannot be read through tensor descriptors, or None."""
    b, h, n, d = tensors[0].shape
    if d < 16 or d & (d - 1):
        return (f"tma=True needs a head dim that is a power of two >= 16 (the descriptor tile is the whole, unmasked "
                f"head dim); got d={d}")
    device = tensors[0].device
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return (f"tma=True needs compute capability >= 9.0 (Hopper's tensor memory accelerator); "
                    f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    if b * h * n >= 2 ** 31:
        return f"tma=True addresses rows of the [B*H*N, d] view with 32-bit coordinates; B*H*N = {b * h * n} >= 2^31"
    for t in tensors:
        if t.data_ptr() % 16:
            return ("tma=True needs 16-byte aligned tensors (a tensor descriptor's base); got one at "
                    f"address {t.data_ptr():#x} (a view at an offset?)")
    return None


def _check_tma(cfg: BlockConfig, kernels, *tensors: torch.Tensor) -> None:
    """Refuse TMA loads (``cfg.uses_tma`` of any of ``kernels``) where the descriptor loads cannot run,
    before any launch: a configuration that asks for them never falls back to the pointer loads silently.
    ``tensors``: the contiguous (B, H, N, d) tensors that will be read through descriptors. Triton's CPU
    interpreter runs tensor descriptors (as masked pointer loads), so ``tma`` is accepted there and the
    interpreter tests compare it bit for bit."""
    if any(cfg.uses_tma(kernel) for kernel in kernels):
        reason = _tma_refusal(*tensors)
        if reason is not None:
            raise ValueError(reason)


def _default_tma(cfg: BlockConfig, *tensors: torch.Tensor) -> BlockConfig:
    """The tuned default's TMA switches where these tensors allow them, else all off. The tuned table is
    the H200's, measured and GPU-tested on bf16 inputs: on a GPU below compute capability 9.0, for tensors a
    descriptor cannot address, and for fp16 and fp32 inputs (whose descriptor loads have not run on a GPU), the
    default configuration loads through pointers instead. That is the same kernel at the same tiles, and the
    loads change no arithmetic (``test_gpu_tma_bitwise``): the outputs are the same bits either way, so this is
    a choice of transport, not a fall-back to another kernel. A ``config=`` that asks for TMA is refused
    instead (``_check_tma``)."""
    if not any(cfg.uses_tma(kernel) for kernel in ("fwd", "dq", "kv")):
        return cfg
    if tensors[0].dtype == torch.bfloat16 and _tma_refusal(*tensors) is None:
        return cfg
    return dataclasses.replace(cfg, tma=False, fwd_tma=False, dq_tma=False, kv_tma=False)


def _descriptors(cfg: BlockConfig, kernel: str, block_rows: int, *tensors: torch.Tensor) -> tuple:
    """Host-side tensor descriptors of contiguous (B, H, N, d) ``tensors`` over their [B*H*N, d] view, one
    tile ``block_rows`` x d, when ``cfg.uses_tma(kernel)`` (after ``_check_tma``); else Nones, which the
    kernel never reads (TMA=False)."""
    if not cfg.uses_tma(kernel):
        return (None,) * len(tensors)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [block_rows, t.shape[-1]]) for t in tensors)


def forward(q, k, v, *, causal: bool = False, scale: float | None = None, config: BlockConfig | None = None,
            _split: bool = True):
    """FlashAttention-2 forward. Returns ``(out, lse)``: out (batch, heads, N, d) in q's dtype,
    lse (batch, heads, N) fp32, the natural-log log-sum-exp of the scaled scores. ``_split=False``
    (tests only) runs the reference path: every key block masked, as before the split (with
    ``config.tma`` no load there is unmasked, so none goes through a descriptor)."""
    scale = _check(q, k, v, causal, scale)
    b, h, n, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = config or _default_tma(default_config(d, causal=causal), q, k, v)
    _check_tma(cfg, ("fwd",), k, v)
    k_desc, v_desc = _descriptors(cfg, "fwd", cfg.fwd_n, k, v)
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    block_d = _block_d(d)
    warps, stages = cfg.launch("fwd")
    grid = (triton.cdiv(n, cfg.fwd_m), b * h)
    _fwd_kernel[grid](q, k, v, k_desc, v_desc, out, lse, n, d, scale, CAUSAL=bool(causal), BLOCK_M=cfg.fwd_m,
                      BLOCK_N=cfg.fwd_n, BLOCK_D=block_d, EVEN_N=_split and _even(n, cfg.fwd_m, cfg.fwd_n),
                      EVEN_D=_split and block_d == d, SPLIT=bool(_split), TMA=cfg.uses_tma("fwd"),
                      HEAVY_FIRST=bool(causal and cfg.heavy_first), EXP2=cfg.uses_exp2("fwd"), num_warps=warps,
                      num_stages=stages)
    return out, lse


def backward(q, k, v, out, lse, grad_out, *, causal: bool = False, scale: float | None = None,
             gproj: str = "off", fp32_backward: bool = False, config: BlockConfig | None = None,
             fp32_dot: str = "ieee", _split: bool = True, _only: str | None = None):
    """FlashAttention-2 backward from the forward's stored ``out`` and ``lse``. Returns
    ``(dq, dk, dv)`` in q's dtype. ``gproj`` in ``GPROJ_MODES``; see the module docstring.
    ``fp32_dot`` (FP32 backward only): ``"ieee"`` (true fp32 products, default), ``"tf32x3"``
    (three TF32 tensor-core products, close to but not bitwise fp32) or ``"bf16x3"`` (bf16 inputs only:
    the fp32 operand split exactly into three bf16 pieces, three bf16 tensor-core products, each
    exact; module docstring).
    ``_split=False``: the reference path (tests only), as in ``forward``. ``_only`` (``"dq"`` or
    ``"kv"``; the launch-config sweep): launch that backward kernel alone, the other gradients left
    unwritten (under GProj dq_dk, ``"kv"`` reads r = 0, which costs what the true r costs)."""
    scale = _check(q, k, v, causal, scale)
    if gproj not in GPROJ_MODES:
        raise ValueError(f"gproj must be one of {GPROJ_MODES}, got {gproj!r}")
    _check_fp32_dot(fp32_dot, q.dtype if fp32_backward else None)
    b, h, n, d = q.shape
    if out.shape != q.shape or grad_out.shape != q.shape or lse.shape != (b, h, n):
        raise ValueError(f"out {tuple(out.shape)}, grad_out {tuple(grad_out.shape)} must be {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {(b, h, n)}")
    q, k, v, out = q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous()
    grad_out = grad_out.to(q.dtype).contiguous()
    cfg = config or _default_tma(default_config(d, fp32_backward, causal=causal, gproj=gproj, fp32_dot=fp32_dot),
                                 q, k, v, grad_out)
    lse = lse.to(torch.float32).contiguous()
    _check_tma(cfg, [kernel for kernel in ("dq", "kv") if _only in (None, kernel)], q, k, v, grad_out)
    block_d = _block_d(d)
    code = _GPROJ_CODE[gproj]
    # the fp32 dots' precision only matters (and only compiles a variant) under the FP32 backward
    f32_dot = fp32_dot if fp32_backward else "ieee"
    even_d = _split and block_d == d

    # -- preprocessing: D_i = rowsum(dO * O) --
    delta = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    _bwd_preprocess_kernel[(triton.cdiv(n, 64), b * h)](out, grad_out, delta, n, d, BLOCK_M=64,
                                                        BLOCK_D=block_d)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # r is only written and read in dq_dk mode; a 1-element dummy otherwise
    if _only not in (None, "dq", "kv"):
        raise ValueError(f"_only must be None, 'dq' or 'kv', got {_only!r}")
    r = (torch.zeros if _only == "kv" else torch.empty)((b, h, n) if code == 2 else (1,), dtype=torch.float32,
                                                          device=q.device)

    # -- dQ first (query-block outer): its r is what dK needs under GProj dq_dk --
    warps, stages = cfg.launch("dq")
    if _only != "kv":
        k_desc, v_desc = _descriptors(cfg, "dq", cfg.dq_n, k, v)
        _bwd_dq_kernel[(triton.cdiv(n, cfg.dq_m), b * h)](
            q, k, v, k_desc, v_desc, grad_out, lse, delta, dq, r, n, d, scale, CAUSAL=bool(causal), GPROJ=code,
            FP32_BWD=bool(fp32_backward), BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, BLOCK_D=block_d,
            EVEN_N=_split and _even(n, cfg.dq_m, cfg.dq_n), EVEN_D=even_d, SPLIT=bool(_split), F32_DOT=f32_dot,
            TMA=cfg.uses_tma("dq"), HEAVY_FIRST=bool(causal and cfg.heavy_first), OVERLAP=cfg.dq_overlap,
            EXP2=cfg.uses_exp2("dq"), RSUM_MMA=bool(cfg.dq_rsum_mma and code != 0 and not fp32_backward
                                                     and q.dtype != torch.float32),
            num_warps=warps, num_stages=stages)
    # -- then dK, dV (key-block outer) --
    warps, stages = cfg.launch("kv")
    if _only != "dq":
        q_desc, do_desc = _descriptors(cfg, "kv", cfg.kv_m, q, grad_out)
        _bwd_dkdv_kernel[(triton.cdiv(n, cfg.kv_n), b * h)](
            q, k, v, q_desc, do_desc, grad_out, lse, delta, r, dk, dv, n, d, scale, CAUSAL=bool(causal), GPROJ=code,
            FP32_BWD=bool(fp32_backward), BLOCK_N=cfg.kv_n, BLOCK_M=cfg.kv_m, BLOCK_D=block_d,
            EVEN_N=_split and _even(n, cfg.kv_n, cfg.kv_m), EVEN_D=even_d, SPLIT=bool(_split), F32_DOT=f32_dot,
            TMA=cfg.uses_tma("kv"), OVERLAP=cfg.kv_overlap, EXP2=cfg.uses_exp2("kv"), num_warps=warps,
            num_stages=stages)
    return dq, dk, dv


def split3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``"bf16x3"`` split of an fp32 tensor as the kernels form it: ``(hi, mid, lo)`` in bf16 with
    ``hi + mid + lo == x`` (``_split3``). For the tests and for reading the method; not on a hot path."""
    if x.dtype != torch.float32:
        raise ValueError(f"split3 takes an fp32 tensor, got {x.dtype}")
    reason = unavailable_reason(x.device)
    if reason is not None:
        raise RuntimeError(f"triton_fa2 cannot run: {reason}")
    flat = x.contiguous().reshape(-1)
    pieces = [torch.empty(flat.shape, dtype=torch.bfloat16, device=x.device) for _ in range(3)]
    if flat.numel():
        _split3_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, *pieces, flat.numel(), BLOCK=1024)
    return tuple(piece.reshape(x.shape) for piece in pieces)


def dot_f32_tile(a: torch.Tensor, b: torch.Tensor, fp32_dot: str) -> torch.Tensor:
    """One FP32-backward dot ``a @ b`` (a fp32 M x K, b K x N in the input format, each side a power of two
    >= 16) through the kernels' own ``_dot_f32``, in fp32: how exact each ``fp32_dot`` is, for the tests."""
    _check_fp32_dot(fp32_dot, b.dtype)
    if a.dtype != torch.float32 or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a must be fp32 (M, K) and b (K, N); got {a.dtype} {tuple(a.shape)}, {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[1]
    if any(size < 16 or size & (size - 1) for size in (m, n, k)):
        raise ValueError(f"M, N, K must be powers of two >= 16, got {(m, n, k)}")
    reason = unavailable_reason(a.device)
    if reason is not None:
        raise RuntimeError(f"triton_fa2 cannot run: {reason}")
    c = torch.empty((m, n), dtype=torch.float32, device=a.device)
    _dot_f32_tile_kernel[(1,)](a.contiguous(), b.contiguous(), c, M=m, N=n, K=k, F32_DOT=fp32_dot)
    return c


class TritonFlashAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, out, lse (no N x N tensor), recomputes P in backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, gproj, fp32_backward, config, fp32_dot):
        out, lse = forward(q, k, v, causal=causal, scale=scale, config=config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(causal=causal, scale=scale, gproj=gproj, fp32_backward=fp32_backward, config=config,
                           fp32_dot=fp32_dot)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, lse, grad_out, **ctx.options)
        return dq, dk, dv, None, None, None, None, None, None


def triton_attention(q, k, v, *, causal: bool = False, scale: float | None = None, gproj: str = "off",
                     fp32_backward: bool = False, config: BlockConfig | None = None, fp32_dot: str = "ieee"):
    """Attention output (batch, heads, N, d) with a FlashAttention-2 Triton forward and backward;
    differentiable in q, k, v. Drop-in for ``scaled_dot_product_attention(q, k, v, is_causal=causal)``
    with n_q == n_k and no mask or dropout."""
    if gproj not in GPROJ_MODES:
        raise ValueError(f"gproj must be one of {GPROJ_MODES}, got {gproj!r}")
    _check_fp32_dot(fp32_dot, q.dtype if fp32_backward else None)  # before the forward, not at the backward
    return TritonFlashAttention.apply(q, k, v, bool(causal), scale, gproj, bool(fp32_backward), config, fp32_dot)
