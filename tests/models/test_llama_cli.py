"""The `dtorch demo` command: report contents, exit codes, checkpoint loading."""
from __future__ import annotations

import torch
import transformers

from dtorch import cli
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
    monkeypatch.setattr(LlamaForCausalLM, "redistribute_output", lambda self, y: real(self, y) + 1e-3)
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
