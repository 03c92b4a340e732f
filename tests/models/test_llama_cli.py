"""The `dtorch demo` command: report contents, exit codes, checkpoint loading."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import dtorch
from dtorch import cli
from dtorch.errors import CheckpointError, DTorchError
from dtorch.models import llama_cli
from dtorch.models.llama import LlamaForCausalLM

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "96", "--batch", "2",
         "--seq", "8"]


def test_demo_reports_layout_error_time_memory_and_communication(capsys):
    assert cli.main(["demo", "--dp", "1", "--ring-cp", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "mesh    cpu[pp=2, tp=2, ulysess_cp=2, ring_cp=2]  (16 simulated cpu devices)" in out
    assert "stage 0: devices 0-7: embed_tokens, layer 0" in out and "stage 1: devices 8-15: layer 1, norm, lm_head" in out
    assert "PASS (rtol = atol = 0.0001" in out and "max |dtorch - Hugging Face|" in out
    assert "dtorch forward" in out and "Hugging Face forward" in out
    assert "memory per device" in out and "MiB" in out
    for row in ("send_recv   pp", "all_reduce  tp", "all_to_all  ulysess_cp", "send_recv   ring_cp"):
        assert row in out


def test_llama_alias_and_single_device(capsys):
    assert cli.main(["llama", "--dp", "1", "--tp", "1", "--pp", "1", "--ulysses-cp", "1", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "(1 simulated cpu devices)" in out and "PASS" in out and "no communication" in out


def test_a_mismatch_fails_with_exit_code_1(capsys, monkeypatch):
    real = LlamaForCausalLM.redistribute_output
    monkeypatch.setattr(LlamaForCausalLM, "redistribute_output", lambda self, y, ids: real(self, y, ids) + 1e-3)
    assert llama_cli.main(["--pp", "1", *SMALL]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bad_layout_exits_2_with_the_reason(capsys):
    assert llama_cli.main(["--tp", "3", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads (4) is not divisible by tp (3)" in err


def test_demo_loads_a_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=100, initializer_range=0.1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    assert llama_cli.main(["--model", str(tmp_path), "--dp", "1", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "loading dtorch model (sharded reads)" in out and f"checkpoint {tmp_path}" in out
    assert "layers 0-1" in out and "PASS" in out


# -- checkpoints that are not Llama, or not checkpoints ------------------------------------------------------


def _refuse_to_build(monkeypatch):
    """Any model built would be wrong here (a non-Llama config used to become a default 7B Llama)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for a directory that is not a Llama checkpoint")
    monkeypatch.setattr(LlamaForCausalLM, "__init__", refuse)


def _gpt2_checkpoint(path):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                  "vocab_size": 100}))
    return path


@pytest.mark.parametrize("kind, message", [
    ("gpt2", "{d} is not a Llama checkpoint (model_type gpt2); dtorch supports model_type llama"),
    ("no model_type", "{d} is not a Llama checkpoint (config.json names no model_type); dtorch supports model_type llama"),
    ("no config.json", "{d} has no config.json"),
    ("bad json", "cannot read {d}/config.json"),
    ("missing", "{d} does not exist"),
    ("a file", "{d} is not a directory"),
])
def test_from_pretrained_refuses_what_is_not_a_llama_checkpoint(tmp_path, monkeypatch, kind, message):
    _refuse_to_build(monkeypatch)
    d = tmp_path / "ckpt"
    if kind == "gpt2":
        _gpt2_checkpoint(d)
    elif kind == "no model_type":
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    elif kind == "no config.json":
        d.mkdir()
    elif kind == "bad json":
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama",')
    elif kind == "a file":
        d.write_text("not a directory")
    with pytest.raises(CheckpointError) as info:
        LlamaForCausalLM.from_pretrained(d)
    assert str(info.value).startswith(message.format(d=d))
    assert isinstance(info.value, DTorchError) and isinstance(info.value, ValueError)


def test_demo_names_a_non_llama_checkpoint_in_one_line_before_building_anything(tmp_path, monkeypatch, capsys):
    _refuse_to_build(monkeypatch)
    d = _gpt2_checkpoint(tmp_path / "gpt2")
    assert cli.main(["demo", "--model", str(d)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"dtorch demo: error: {d} is not a Llama checkpoint (model_type gpt2); dtorch supports model_type llama\n"


# -- bad numbers: one line, exit code 2, nothing run ----------------------------------------------------------


@pytest.mark.parametrize("flags, says", [
    (["--seq", "0"], "--seq 0 must be at least 1"),
    (["--batch", "0"], "--batch 0 must be at least 1"),
    (["--batch", "-3"], "--batch -3 must be at least 1"),
    (["--layers", "0"], "--layers 0 must be at least 1"),
    (["--vocab", "0"], "--vocab 0 must be at least 1"),
    (["--hidden", "-4"], "--hidden -4 must be at least 1"),
    (["--heads", "0"], "--heads 0 must be at least 1"),
    (["--kv-heads", "0"], "--kv-heads 0 must be at least 1"),
    (["--intermediate", "0"], "--intermediate 0 must be at least 1"),
    (["--dp", "0"], "--dp 0 must be at least 1"),
    (["--ring-cp", "-1"], "--ring-cp -1 must be at least 1"),
    (["--tolerance", "-1"], "--tolerance -1 must be a number >= 0"),
    (["--heads", "6", "--hidden", "100", "--kv-heads", "2", "--ulysses-cp", "1"],
     "--hidden 100 is not divisible by --heads 6 (each head takes hidden / heads features); use --hidden 96 or 108"),
    (["--heads", "6", "--hidden", "66", "--kv-heads", "2", "--ulysses-cp", "1"],
     "--hidden 66 / --heads 6 = 11 features per head, which must be even"),
    (["--seq", "9"], "--seq 9 is not divisible by --ulysses-cp 2 (Ulysses splits the sequence evenly); use --seq 8 or 10, "
                     "or --ulysses-cp 1, 3 or 9"),
    (["--tp", "8"], "num_attention_heads (4) is not divisible by tp (8)"),
    (["--tp", "3"], "num_attention_heads (4) is not divisible by tp (3)"),
    (["--pp", "4"], "num_hidden_layers (2) is smaller than pp (4)"),
    (["--heads", "2", "--kv-heads", "2"], "the 1 query heads per tp shard (num_attention_heads 2 / tp 2) are not "
                                          "divisible by ulysess_cp (2)"),
])
def test_bad_numbers_exit_2_with_one_line_saying_what_to_change(capsys, flags, says):
    assert cli.main(["demo", *SMALL, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing was built or run
    assert err.startswith("dtorch demo: error: ") and err.count("\n") == 1 and says in err, err
    if "tp (" in says or "pp (" in says or "ulysess_cp (" in says:  # mesh dim names mapped back to the flags
        assert "--tp, --ulysses-cp and --pp set tp, ulysess_cp and pp" in err


def test_every_bad_flag_is_named_at_once(capsys):
    assert llama_cli.main([*SMALL, "--seq", "0", "--vocab", "-2", "--tp", "3", "--tolerance", "-1"]) == 2
    err = capsys.readouterr().err
    for says in ("--seq 0 must be at least 1", "--vocab -2 must be at least 1", "--tolerance -1 must be",
                 "num_attention_heads (4) is not divisible by tp (3)"):
        assert says in err
    assert err.count("\n") == 1


def test_a_mesh_larger_than_the_backend_allows(monkeypatch, capsys):
    monkeypatch.setenv("DTORCH_PROCESS_MAX_WORKERS", "8")
    with dtorch.Graph(backend="process"):  # no worker starts: the flags are refused first
        assert llama_cli.main(SMALL) == 2  # dp2 x tp2 x pp2 x ulysses2 = 16 devices
    assert ("the mesh has 16 devices (--dp x --tp x --pp x --ulysses-cp x --ring-cp) but the process backend allows "
            "8 workers") in capsys.readouterr().err
    monkeypatch.setenv("DTORCH_DTENSOR_IN_SAME_DEVICE", "1")
    monkeypatch.setenv("DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE", "4")
    with dtorch.Graph():
        assert llama_cli.main([*SMALL, "--device", "cuda"]) == 2
    assert "simulated GPUs exist; raise DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE to at least 16" in \
        capsys.readouterr().err


def test_the_report_says_what_the_devices_are_under_each_backend():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    assert llama_cli._where(mesh) == ("every device simulated in this process", "4 simulated cpu devices")
    with dtorch.Graph(backend="process"):  # workers would start only on the first op
        assert llama_cli._where(mesh) == ("one worker process per device (process backend)",
                                          "4 cpu devices, one worker process each")
