"""How a fault of the machine is recognised and said (``polyrl.core.run.faults``), and ``polyrl export`` on a full
disk: refused before writing when the space is short, and a write that fails leaves no half-written model."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch
from fault_injection import MIB, no_space, small_fs
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GptOssConfig, GptOssForCausalLM

from polyrl.cli import main as cli_main
from polyrl.core.run import checkpoint as C
from polyrl.core.run import faults as F
from polyrl.core.run import integrity as I
from polyrl.core.run.export import save_model_metadata


# --- recognising a fault -------------------------------------------------------------------------------------
def _dcp_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BaseException:
    """What DCP raises when a shard's write meets a full disk (the ENOSPC deep inside its CheckpointException)."""
    monkeypatch.setattr(I._HashingStream, "write", lambda self, data: (_ for _ in ()).throw(no_space()))
    model = torch.nn.Linear(64, 64)
    with pytest.raises(BaseException) as info:
        C.save_checkpoint(tmp_path / "ckpt", 1, {"model": model})
    return info.value


def test_a_full_disk_is_found_inside_dcps_checkpoint_exception(tmp_path: Path, monkeypatch) -> None:
    exc = _dcp_failure(tmp_path, monkeypatch)
    # the save turned it into its own fault, and removed its partial directory
    assert isinstance(exc, F.NotEnoughSpace) and not exc.before
    assert not list((tmp_path / "ckpt").glob("step_*"))
    inner = exc.__cause__
    assert type(inner).__name__ == "CheckpointException"
    err = F.os_error_in(inner)
    assert err is not None and err.errno == errno.ENOSPC
    assert F.fault_line(inner, "while saving step 1", tmp_path) == (
        f"no space left on {tmp_path} while saving step 1; free space")


def test_errors_the_module_does_not_know_keep_their_traceback() -> None:
    assert F.fault_line(ValueError("a bug")) is None
    assert F.fault_line(OSError(errno.ECONNRESET, "reset by peer")) is None  # a broken collective is no disk fault
    assert F.os_error_in(RuntimeError("unexpected pos 704 vs 598")) is None


def test_the_errno_in_a_rust_io_message_counts() -> None:
    """safetensors (the HF export) reports the errno only inside its message."""
    exc = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert F.os_error_in(exc).errno == errno.ENOSPC
    assert F.fault_line(exc, "while writing the export", "/x") == "no space left on /x while writing the export; free space"


@pytest.mark.parametrize(("code", "cause", "todo"), [
    (errno.EACCES, "permission denied on /r/metrics.jsonl", "make it writable"),
    (errno.EROFS, "/r/metrics.jsonl is on a read-only file system", "make it writable"),
    (errno.EDQUOT, "disk quota exceeded on /r/metrics.jsonl", "free space or raise the quota"),
])
def test_each_file_system_fault_says_what_to_do(code: int, cause: str, todo: str) -> None:
    err = OSError(code, os.strerror(code), "/r/metrics.jsonl")
    assert F.fault_line(RuntimeError("wrapped"), "") is None
    wrapped = RuntimeError("wrapped")
    wrapped.__context__ = err
    assert F.fault_line(wrapped, "while logging step 3") == f"{cause} while logging step 3; {todo}"


def test_a_write_without_errno_on_a_nearly_full_disk_is_out_of_space(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer reports a short write as 'unexpected pos' with no errno (the issue's traceback)."""
    exc = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert not F.is_out_of_space(exc, tmp_path)  # this disk has room: a bug, not a full disk
    monkeypatch.setattr(F, "free_bytes", lambda path: F.NEARLY_FULL_BYTES // 2)
    assert F.is_out_of_space(exc, tmp_path)


# --- polyrl export ---------------------------------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    cfg = GptOssConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()  # ~1.5 MiB of float32 weights
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(10)} | {"<unk>": 10}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ckpt = tmp_path / "run" / "checkpoints"
    save_model_metadata(ckpt, model, tok)
    C.save_checkpoint(ckpt, 2, {"model": model})
    return tmp_path / "run"


def _export(run_dir: Path, out: Path, capsys) -> tuple[int, str]:
    """Exit code and polyrl's one line (transformers' own progress bar may come before it)."""
    rc = cli_main(["export", str(run_dir), str(out)])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("polyrl export:")]
    assert "Traceback" not in err and len(said) == (rc != 0), err
    return rc, said[0] if said else ""


def test_export_without_the_space_is_refused_before_writing(run_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    with small_fs(tmp_path / "fs", 1) as fs:  # 1 MiB: the export needs ~1.5
        out = tmp_path / "fs" / "hf"
        if fs is None:
            monkeypatch.setattr(F, "free_bytes", lambda path: MIB // 2)
        rc, err = _export(run_dir, out, capsys)
        assert rc == 1
        assert re.fullmatch(rf"polyrl export: error: not enough space on {out} for the export \(needs ~1\.\d MiB, "
                            r"[01]\.\d MiB free\); nothing was written; free space", err), err
        assert not out.exists()
        monkeypatch.undo()
        if fs is not None:
            fs.resize(8)
        assert _export(run_dir, out, capsys)[0] == 0  # the same command, space freed
        assert (out / "model.safetensors").is_file()


def test_export_that_fills_the_disk_leaves_nothing_half_written(run_dir: Path, tmp_path: Path, monkeypatch,
                                                                capsys) -> None:
    import safetensors
    import transformers.modeling_utils as MU

    with small_fs(tmp_path / "fs", 8) as fs:
        out = tmp_path / "fs" / "hf"
        real = MU.safe_save_file  # save_pretrained's own reference to safetensors' save_file

        def filling(*args, **kwargs):  # the disk fills as the weights are written (another process)
            if fs is not None:
                fs.fill(leave=64 * 1024)
                return real(*args, **kwargs)
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device "
                                              "(os error 28)")  # what safetensors raises on a full disk

        monkeypatch.setattr(MU, "safe_save_file", filling)
        rc, err = _export(run_dir, out, capsys)
        assert rc == 1
        assert re.fullmatch(rf"polyrl export: error: no space left on {out} while writing the export \(needs ~1\.\d "
                            r"MiB, \d+\.\d MiB free\); free space", err), err
        assert not out.exists()  # no directory that looks like an exported model
        monkeypatch.undo()
        if fs is not None:
            (fs.path / "filler").unlink()
        assert _export(run_dir, out, capsys)[0] == 0
