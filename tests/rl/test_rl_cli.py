"""``dtorch rl``: bad flags give one clear error; a short run on the default layout reports the time per role,
the bytes per weight sync and the reward curve; the same code runs on the process backend; and (slow) the
acceptance: the default run at least doubles the mean reward of its first 10 steps."""
from __future__ import annotations

import pytest

import dtorch
from dtorch.cli import main as dtorch_main
from dtorch.rl import cli


def run(capsys, *argv):
    code = dtorch_main(["rl", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,message", [
    (["--gen-tp", "3"], "rollout: mesh cpu[dp=2, tp=3] cannot serve this Llama config: num_attention_heads (4) is "
                        "not divisible by tp (3)"),
    (["--group", "1", "--steps", "0"], "--steps 0 must be at least 1; --group 1 must be at least 2"),
    (["--train-fsdp", "1", "--colocate"], "--colocate puts the rollout's 4 devices on the trainer's 2"),
    (["--prompts", "3", "--group", "3"], "--prompts 3 x --group 3 = 9 sequences do not split over --train-dp x "
                                         "--train-fsdp = 2"),
])
def test_bad_flags_give_one_clear_error(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("dtorch rl: error: ") and err.count("\n") == 1
    assert message in err


def test_a_short_run_reports_roles_sync_bytes_and_the_reward_curve(capsys, tmp_path):
    png = tmp_path / "reward.png"
    before = dtorch.default_graph()
    code, out, err = run(capsys, "--steps", "3", "--prompts", "4", "--group", "2", "--no-progress", "--plot", str(png))
    assert code == 0, err
    assert "trainer   cpu[fsdp=2, tp=2]" in out and "rollout   cpu[dp=2, tp=2]" in out
    for role in cli.ROLES:
        assert role in out
    assert "moved between devices per sync" in out and "mean reward" in out
    assert png.stat().st_size > 0
    assert dtorch.default_graph() is before


def test_the_same_code_runs_on_the_process_backend(capsys):
    code, out, err = run(capsys, "--backend", "process", "--train-fsdp", "2", "--train-tp", "1", "--gen-dp", "1",
                         "--gen-tp", "2", "--colocate", "--steps", "2", "--prompts", "2", "--group", "2", "--no-progress")
    assert code == 0, err
    assert "one worker process per device (process backend)" in out and "weight sync" in out


@pytest.mark.slow
def test_the_default_run_learns():
    """The issue's acceptance: the mean reward of the last 10 steps at least twice that of the first 10."""
    args = cli.build_parser().parse_args(["--no-progress"])
    assert not cli.check_args(args)
    result = cli.train(args, progress=False)
    first, last = sum(result.rewards[:10]) / 10, sum(result.rewards[-10:]) / 10
    assert first > 0 and last >= 2 * first, (first, last)
