"""The notebook kernel's transport: IPC sockets in a private folder, so ipykernel has no "running over TCP
without encryption" warning to print (ipykernel/kernelapp.py, IPKernelApp.init_sockets).

The kernels here are started with jupyter_client directly, with the runner's own options
(``attnum.runs.execute.kernel_transport``) and, as the control, with jupyter_client's defaults (TCP)."""
import os
import stat

from jupyter_client.manager import KernelManager

from attnum.runs import execute

WARNING = "Kernel is running over TCP without encryption"


def _kernel_stderr(tmp_path, config) -> tuple[str, dict, str]:
    """Start a python3 kernel with ``config``, run one cell, stop it: (its stderr, its connection info, the
    cell's output)."""
    err = tmp_path / "kernel-stderr.txt"
    km = KernelManager(kernel_name="python3", **({"config": config} if config is not None else {}))
    with open(err, "w") as fh:
        km.start_kernel(stderr=fh)
    kc = km.client()
    out = []
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        kc.execute_interactive("print(6 * 7)", timeout=60,
                               output_hook=lambda m: out.append(m["content"].get("text", "")))
        info = km.get_connection_info()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return err.read_text(), info, "".join(out)


def test_the_runners_kernel_listens_on_private_ipc_sockets_and_prints_no_tcp_warning(tmp_path):
    with execute.kernel_transport() as options:
        config = options["config"]
        folder = os.path.dirname(config.KernelManager.ip)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # only this user can reach the sockets
        stderr, info, out = _kernel_stderr(tmp_path, config)
        assert info["transport"] == "ipc" and info["ip"].startswith(folder + os.sep)
    assert out.strip() == "42"
    assert WARNING not in stderr, stderr
    assert not os.path.exists(folder)  # the sockets' folder goes with the run


def test_the_control_a_tcp_kernel_prints_the_warning(tmp_path):
    """The premise of the test above: jupyter_client's default transport (TCP) makes ipykernel warn."""
    stderr, info, out = _kernel_stderr(tmp_path, None)
    assert info["transport"] == "tcp" and out.strip() == "42"
    assert WARNING in stderr


def test_a_socket_folder_path_too_long_for_a_unix_socket_keeps_tcp(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with execute.kernel_transport() as options:
        assert options == {}
    assert list(deep.iterdir()) == []  # its temporary folder is removed all the same
