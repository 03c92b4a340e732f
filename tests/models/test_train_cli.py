"""dtorch train: trains (the loss goes down), reports memory and communication, saves a checkpoint that
transformers loads to the same logits, and refuses bad flags with messages that say what to change."""
from __future__ import annotations

from pathlib import Path

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
    (["--recover", "shrink", "--dp", "1"], "--recover shrink drops the lost device's slice of the dp dim, so it needs "
                                           "--dp 2 or more (got --dp 1); raise --dp or use --recover replace"),
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


def test_plot_draws_the_loss_curve(tmp_path, capsys):
    """matplotlib is the plot extra run.sh installs: --plot works after the README's set-up (no skip)."""
    out = tmp_path / "loss.png"
    assert train_cli.main(SMALL + ["--steps", "2", "--dp", "1", "--tp", "1", "--plot", str(out)]) == 0
    assert f"loss curve: {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_sh_installs_the_plot_extra():
    run_sh = (Path(__file__).resolve().parents[2] / "run.sh").read_text()
    assert '-e ".[test,ray,plot]"' in run_sh
    assert "u.find_spec('matplotlib')" in run_sh  # an existing .venv without it is brought up to date


def test_saved_directory_generates_with_dtorch_generate_and_hugging_face(tmp_path, capsys):
    """dtorch train --save DIR writes what dtorch generate --model DIR takes: the checkpoint, its generation
    config and a byte-level tokenizer that transformers' AutoTokenizer reads as the bytes trained on."""
    from dtorch.cli import main

    assert main(["train", *SMALL, "--steps", "3", "--tp", "1", "--save", str(tmp_path)]) == 0
    capsys.readouterr()
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "the cat", "--prompt", "a", "--tp", "2", "--pp", "1",
               "--dp", "2", "--max-new-tokens", "5", "--check"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "PASS, the same tokens" in out and "vocab 256" in out
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo,\n world"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id is None  # no byte ends a text


def _option_help(parser) -> dict:
    """option -> its help block in ``--help`` (the option line and the lines under it)."""
    blocks, current = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("command", ["train", "generate", "demo"])
def test_help_shows_every_default(command):
    from dtorch.models import generate_cli, llama_cli

    parser = {"train": train_cli, "generate": generate_cli, "demo": llama_cli}[command].build_parser()
    blocks = _option_help(parser)
    options = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 10 and set(options) <= set(blocks)
    for option in options:
        assert "(default: " in blocks[option], blocks[option]
        assert blocks[option].count("default:") == 1, blocks[option]  # (a default stated once)
