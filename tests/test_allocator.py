"""fedpriv.allocator: glibc keeps freed memory in fedpriv's processes (a step's tensors reuse the
pages of the step before instead of faulting in fresh ones), and the user's settings win."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc's")

CHURN = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    from fedpriv import allocator
    print(",".join(allocator.tune()) or "-" if sys.argv[1] == "tuned" else "-")

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    for _ in range(3):  # a step's tensors: eight 16 MiB blocks, all freed at its end
        blocks = [np.ones(2 * 2**20) for _ in range(8)]
        mapped = mallinfo2().hblkhd  # bytes in blocks of their own (mmap)
        del blocks
    # the heap's size from the system, after the last step freed everything
    print(mapped // 2**20, mallinfo2().arena // 2**20)
""")


def _python(code, *args, **env):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "FEDPRIV_MALLOC"}
    out = subprocess.run([sys.executable, "-c", code, *args], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_tuned_steps_keep_their_memory():
    """glibc's defaults give a step's freed blocks back to the system (the next step faults
    fresh pages in); tuned, the heap keeps them for the next step and none is a mapping of
    its own."""
    names, mapped, kept = _python(CHURN, "tuned")
    assert names == "MALLOC_MMAP_THRESHOLD_,MALLOC_TRIM_THRESHOLD_,MALLOC_TOP_PAD_"
    assert int(mapped) == 0 and int(kept) >= 128
    _, mapped, kept = _python(CHURN, "system")
    assert int(kept) < 64


def test_the_users_settings_win():
    """Any MALLOC_* variable in the environment: the user's settings, glibc's to apply, and
    fedpriv changes nothing (a sweep's workers start with ``ENV``, applied the same way)."""
    code = "from fedpriv import allocator; print(','.join(allocator.tune()) or '-')"
    assert _python(code, FEDPRIV_MALLOC="system") == ["-"]
    assert _python(code, MALLOC_TRIM_THRESHOLD_="131072") == ["-"]
    names, _, kept = _python(CHURN, "tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert names == "-" and int(kept) < 64
    from fedpriv.allocator import ENV
    names, mapped, kept = _python(CHURN, "tuned", **ENV)
    assert names == "-" and int(mapped) == 0 and int(kept) >= 128


def test_fedprivs_processes_tune_it():
    """The fedpriv command, the ServerApp and the ClientApp of the Flower app."""
    code = textwrap.dedent("""
        from fedpriv import allocator
        import clients.app, strategies.server_app
        print("apps", len(allocator.tune()))
        allocator._state.clear()
        from fedpriv.cli import main
        main(["algorithms", "fewshot-meta-nsgd"])
        print("command", len(allocator._state[0]))
    """)
    out = _python(code)
    assert out[out.index("apps") + 1] == out[out.index("command") + 1] == "3"
