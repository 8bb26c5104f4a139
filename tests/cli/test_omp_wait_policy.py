"""`polyrl run` picks OpenMP's wait policy before torch loads: passive only when other processes keep more
than half the cores busy right now; the user's setting and a launcher's decision win. Run in a child
interpreter, since in this one torch is loaded already (and the choice is then, rightly, a no-op)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys
    import polyrl.cli.run
    from polyrl.core.distributed import process as P
    assert "torch" not in sys.modules, "the policy module must not load torch: the policy is read when it loads"
    P.apply_openmp_policy(sample=lambda: float(sys.argv[1]))
    assert os.environ["OMP_DYNAMIC"] == "FALSE"
    print(os.environ.get("OMP_WAIT_POLICY", "-"), os.environ.get("POLYRL_OMP_WAIT_DECIDED", "-"))
""")


def _choice(busy_cores: float, **env: str) -> str:
    child = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "POLYRL_OMP_WAIT_DECIDED")}
    child.update(env)
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(busy_cores)], env=child, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.mark.parametrize("share,expected", [(0.0, "- 1"), (0.4, "- 1"), (0.6, "PASSIVE 1"), (1.0, "PASSIVE 1")])
def test_passive_only_when_other_processes_keep_over_half_the_cores_busy(share: float, expected: str) -> None:
    assert _choice(share * (os.cpu_count() or 1)) == expected


def test_the_users_setting_and_the_launchers_decision_win() -> None:
    cores = os.cpu_count() or 1
    assert _choice(cores, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE -"
    assert _choice(cores, POLYRL_OMP_WAIT_DECIDED="1") == "- 1"


def test_the_busy_sample_sees_a_busy_core() -> None:
    """The /proc/stat sample measures what others do: one spinning child process shows as ~1 busy core."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat: the load average is used instead")
    from polyrl.core.distributed.process import busy_cores

    idle = busy_cores(0.3)
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and idle is not None
    assert busy >= 0.7, (idle, busy)  # the spinner alone is one core
