"""Which release of Ascend Extension for PyTorch (TorchNPU) a torch_npu version belongs to, for the emulator
(polyrl.emulation.npu): the op signatures and op-plugin behaviours it emulates change with the release, not with the
version string (op_plugin/config/op_plugin_functions.yaml on op-plugin's 7.1.0, 7.2.0, 7.3.0 and 26.0.0 branches):
  up to 7.1.0: neither softmax_layout nor sink; the grad op returns 4 tensors (dq, dk, dv, dpse);
  7.2.0: softmax_layout="" on both ops;
  7.3.0 on: sink=None on both ops; the grad op returns 5 tensors (dsink last);
  26.0.0 on: the forward also takes dropout_mask=, seed=, offset=; an Ascend 950 path (the forward drops sink=).

_FIRST_OF_RELEASE: the first torch_npu of a release per torch minor (Ascend/pytorch version.txt at the release tags).
"""

from __future__ import annotations

RELEASES = ("7.1.0", "7.2.0", "7.3.0", "26.0.0")
_FIRST_OF_RELEASE: dict[str, dict[tuple[int, int], str]] = {
    "26.0.0": {(2, 7): "2.7.1.post4", (2, 8): "2.8.0.post4", (2, 9): "2.9.0.post2", (2, 10): "2.10.0"},
    "7.3.0": {(2, 6): "2.6.0.post5", (2, 7): "2.7.1.post2", (2, 8): "2.8.0.post2", (2, 9): "2.9.0"},
    "7.2.0": {(2, 6): "2.6.0.post3", (2, 7): "2.7.1", (2, 8): "2.8.0"},
}


def release_at_least(release: str, other: str) -> bool:
    """Order of TorchNPU releases (by position in RELEASES: "26.0.0" follows "7.3.0")."""
    return RELEASES.index(release) >= RELEASES.index(other)


def release_of(version: str) -> str:
    """The TorchNPU release of a torch_npu version (a torch minor newer than the table's: the newest release)."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return RELEASES[0]
    newest = max(minor for firsts in _FIRST_OF_RELEASE.values() for minor in firsts)
    if (v.major, v.minor) > newest:
        return RELEASES[-1]
    for release in reversed(RELEASES[1:]):
        first = _FIRST_OF_RELEASE[release].get((v.major, v.minor))
        if first is not None and v >= Version(first):
            return release
    return RELEASES[0]
