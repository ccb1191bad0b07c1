"""fedpriv.allocator: glibc keeps freed memory in fedpriv's processes (a step's tensors reuse the
pages of the step before instead of faulting in fresh ones), and the user's settings win."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from fedpriv import allocator

_LIBC, _VERSION = platform.libc_ver()
pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or _LIBC != "glibc"
    or tuple(int(p) for p in _VERSION.split(".")[:2]) < (2, 33),
    reason="the settings are glibc's; mallinfo2 reads them back from glibc 2.33 on")

# Prints the settings applied, then three readings of glibc's heap in MiB: with a first 16 MiB
# block live, the heap's size (the top pad grows it in 512 MiB steps) and the bytes in blocks
# mapped on their own (the mmap threshold: none; glibc's default maps it); then the heap's
# size once 48 such blocks are freed (the trim threshold keeps them).
CHURN = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    from fedpriv import allocator
    print(",".join(allocator.tune()) or "-" if sys.argv[1] == "tuned" else "-")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    MiB = 2**20
    one = np.ones(2 * MiB)
    grown, mapped = mallinfo2().arena // MiB, mallinfo2().hblkhd // MiB
    del one
    for _ in range(2):  # a step's tensors, all freed at its end
        blocks = [np.ones(2 * MiB) for _ in range(48)]
        del blocks
    print(grown, mapped, mallinfo2().arena // MiB)
""")


def _python(code, *args, **env):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("FEDPRIV_MALLOC", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", code, *args], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def _readings(*args, **env):
    names, grown, mapped, kept = _python(CHURN, *args, **env)
    return names, int(grown), int(mapped), int(kept)


def test_tuned_steps_keep_their_memory():
    """glibc's defaults give a step's freed blocks back to the system (the next step faults
    fresh pages in); tuned, each of the three settings shows: the heap grows in 512 MiB
    steps, no 16 MiB block is mapped on its own, and the freed 768 MiB stay in the heap."""
    names, grown, mapped, kept = _readings("tuned")
    assert names == "MALLOC_MMAP_THRESHOLD_,MALLOC_TRIM_THRESHOLD_,MALLOC_TOP_PAD_"
    assert grown >= 512 and mapped == 0 and kept >= 768
    _, grown, mapped, kept = _readings("system")
    assert grown < 64 and mapped == 16 and kept < 64


def test_the_users_settings_win():
    """Any MALLOC_* variable or glibc.malloc tunable: the user's settings, glibc's to apply,
    and fedpriv changes nothing; a sweep's workers start with ``ENV`` only where ``tune``
    would apply it, and it has the same effect."""
    code = "from fedpriv import allocator; print(','.join(allocator.tune()) or '-')"
    assert _python(code, FEDPRIV_MALLOC="system") == ["-"]
    assert _python(code, MALLOC_ARENA_MAX="2") == ["-"]
    assert _python(code, GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072") == ["-"]
    assert _python(code, GLIBC_TUNABLES="glibc.rtld.nns=2") != ["-"]
    assert not allocator.wanted({"FEDPRIV_MALLOC": "system"})
    assert not allocator.wanted({"MALLOC_TOP_PAD_": "0"})
    assert allocator.wanted({})
    names, grown, _, kept = _readings("tuned", MALLOC_TRIM_THRESHOLD_="131072")
    assert names == "-" and grown < 64 and kept < 64
    names, grown, mapped, kept = _readings("system", **allocator.ENV)
    assert grown >= 512 and mapped == 0 and kept >= 768


@pytest.mark.parametrize("entry", ["import clients.app", "import strategies.server_app",
                                   "from fedpriv.cli import main; main(['algorithms'])"])
def test_fedprivs_processes_tune_it(entry):
    """The ClientApp and the ServerApp of the Flower app, and the fedpriv command, each in a
    fresh process: the settings in force without anyone else calling ``tune``."""
    code = (f"{entry}\nfrom fedpriv import allocator\n"
            "assert allocator.tune.cache_info().currsize == 1  # called already, by the entry\n"
            "print('tuned', allocator.tune())")
    out = _python(code)
    assert out[out.index("tuned") + 1:] == [
        "('MALLOC_MMAP_THRESHOLD_',", "'MALLOC_TRIM_THRESHOLD_',", "'MALLOC_TOP_PAD_')"]
