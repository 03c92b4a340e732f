"""dtorch train: trains (the loss goes down), reports memory and communication, saves a checkpoint that
transformers loads to the same logits, and refuses bad flags with messages that say what to change."""
from __future__ import annotations

import pytest
import torch
import transformers

from dtorch.models import train_cli

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq", "16", "--batch", "4",
         "--pp", "1", "--ulysses-cp", "1"]


def test_training_lowers_the_loss_and_the_saved_checkpoint_loads_in_transformers(tmp_path):
    args = train_cli.build_parser().parse_args(SMALL + ["--steps", "8", "--lr", "1e-2"])
    assert train_cli.check_args(args) == []
    r = train_cli.train(args, progress=False)
    assert r.losses[-1] < r.losses[0] - 0.3, r.losses
    train_cli.save_hf_checkpoint(r.model, r.config, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(r.model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    # the step recorded: gradients all-reduced on dp, activations on tp
    kinds = r.log.counts()
    assert kinds[("all_reduce", "dp")] >= len(list(r.model.parameters()))
    assert ("all_reduce", "tp") in kinds


def test_main_prints_the_memory_and_communication_tables(capsys):
    assert train_cli.main(SMALL + ["--steps", "2", "--dp", "1", "--fsdp", "2"]) == 0
    out = capsys.readouterr().out
    for needle in ("weights", "grads", "optimizer", "activation peak", "reduce_scatter", "fsdp", "tokens/s"):
        assert needle in out, needle


@pytest.mark.parametrize("flags,message", [
    (["--hidden", "30"], "--hidden 30 is not divisible by --heads 4 (each head takes hidden / heads features); "
                         "use --hidden 24 or 32"),
    (["--seq", "15", "--ulysses-cp", "2"], "--seq 15 must be divisible by --ulysses-cp 2"),
    (["--text", "/nonexistent/file.txt"], "no such file"),
    (["--tp", "3"], "tp (3)"),
])
def test_bad_flags_say_what_to_change(flags, message, capsys):
    assert train_cli.main(SMALL + flags) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert train_cli.main(SMALL + ["--plot", "loss.png"]) == 2
    assert "dtorch[plot]" in capsys.readouterr().err


def test_plot_draws_the_loss_curve(tmp_path):
    pytest.importorskip("matplotlib", reason="the optional plot extra (pip install 'dtorch[plot]') is not installed")
    out = tmp_path / "loss.png"
    train_cli.plot_losses([3.0, 2.5, 2.1], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
