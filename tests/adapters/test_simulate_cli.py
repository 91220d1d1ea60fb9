"""`gpupart simulate`: built-in example, trace replay, JSON and plot output, and every bad-input
path (exit code 2, one line on stderr naming the file and line)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpupart.cli import main
from gpupart.simulate import Progress

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,96000,393216,8,G2\n"
PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
    + "".join(f"p{i},4000,8192,1,{(250, 500, 810, 1000)[i % 4]}\n" for i in range(12))
    + "big,8000,8192,8,1000\ncpu,2000,1024,0,0\n"
)


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, Path]:
    nodes = tmp_path / "nodes.csv"
    pods = tmp_path / "pods.csv"
    nodes.write_text(NODES)
    pods.write_text(PODS)
    return nodes, pods


def test_no_arguments_runs_the_built_in_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate"]) == 0
    out = capsys.readouterr().out
    assert "built-in example" in out
    for policy in ("random", "bestfit", "fgd", "gpupart"):
        assert f"\n{policy} " in out


def test_json_has_the_documented_fields(
    trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = trace
    code = main(
        [
            "simulate",
            "--nodes",
            str(nodes),
            "--pods",
            str(pods),
            "--policy",
            "fgd",
            "--seed",
            "5",
            "--load",
            "1.3",
            "--json",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["policy"] == "fgd" and data["seed"] == 5 and data["load"] == 1.3
    assert 0 < data["allocation_ratio"] <= 100
    assert data["unallocated_gpus"] == pytest.approx(10 * (1 - data["allocation_ratio"] / 100))
    assert isinstance(data["failed_pods"], int)
    assert len(data["curve"]) == 131 and data["curve"][-1] == data["allocation_ratio"]


def test_json_of_several_policies_lists_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--json", "--policy", "bestfit,gpupart"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy"] == "gpupart"
    assert [run["policy"] for run in data["runs"]] == ["bestfit", "gpupart"]


def test_plot_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "curves.png"
    assert main(["simulate", "--policy", "bestfit,fgd", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(target) in capsys.readouterr().out


def test_same_seed_same_answer(
    trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = trace
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "random", "--json"]
    main(args)
    first = json.loads(capsys.readouterr().out)
    main(args)
    again = json.loads(capsys.readouterr().out)
    first.pop("seconds"), again.pop("seconds")
    assert first == again


@pytest.mark.parametrize(
    ("which", "content", "expected"),
    [
        pytest.param("pods", "", "pods.csv:1: empty file", id="empty-pods"),
        pytest.param("nodes", "", "nodes.csv:1: empty file", id="empty-nodes"),
        pytest.param(
            "pods",
            "name,cpu_milli,memory_mib,num_gpu\np,1,1,0\n",
            "pods.csv:1: bad header (missing gpu_milli",
            id="missing-column",
        ),
        pytest.param(
            "pods",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,x\np,1,1,0,0,1\n",
            "pods.csv:1: bad header (unexpected x",
            id="extra-column",
        ),
        pytest.param(
            "nodes",
            "sn,cpu_milli,memory_mib,gpu,model,rack\nn,1,1,1,T4,r\n",
            "nodes.csv:1: bad header (unexpected rack",
            id="extra-node-column",
        ),
        pytest.param(
            "pods",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,0,0\nq,1,lots,0,0\n",
            "pods.csv:3: column 'memory_mib'",
            id="non-numeric",
        ),
    ],
)
def test_bad_input_exits_2_naming_file_and_line(
    trace: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    which: str,
    content: str,
    expected: str,
) -> None:
    nodes, pods = trace
    (nodes if which == "nodes" else pods).write_text(content)
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(pods)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert expected in err


def test_a_trace_with_unplaceable_pods_is_replayed_to_the_end(
    trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = trace
    # 16 GPUs on no node; more CPU than any node; a GPU model no node has: each fails, the rest
    # of the replay goes on
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    header += "creation_time,deletion_time,scheduled_time\n"
    rows = [line + ",,,,,," for line in PODS.splitlines()[1:]]
    rows += ["huge,1,1,16,1000,,,,,,", "hungry,512000,1,0,0,,,,,,", "v100,1000,1,1,500,V100,,,,,"]
    pods.write_text(header + "\n".join(rows) + "\n")
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--load", "0"]
    assert main([*args, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["arrived_pods"] == 17 and answer["placed_pods"] + answer["failed_pods"] == 17
    unplaceable = answer["unplaceable_pods"]
    assert unplaceable["count"] == 3 and answer["failed_pods"] >= 3
    assert {e.split(" ")[1] for e in unplaceable["examples"]} == {"'huge'", "'hungry'", "'v100'"}
    assert all("larger than any node" in e for e in unplaceable["examples"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 arrived pods could not be placed on any node" in out and "'huge' (line 16)" in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["--nodes", "NODES"], "needs both --nodes and --pods", id="only-nodes"),
        pytest.param(
            ["--nodes", "NODES", "--pods", "missing.csv"],
            "missing.csv: cannot read",
            id="missing-file",
        ),
        pytest.param(["--policy", "fastest"], "unknown policy 'fastest'", id="unknown-policy"),
        pytest.param(["--load", "-1"], "--load must be 0 or more", id="negative-load"),
    ],
)
def test_flag_misuse_exits_2(
    trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    nodes, _ = trace
    args = [str(nodes) if a == "NODES" else a for a in args]
    assert main(["simulate", *args]) == 2
    assert expected in capsys.readouterr().err


def test_the_installed_command_runs_the_example() -> None:
    import subprocess
    import sys

    gpupart = Path(sys.executable).with_name("gpupart")
    if not gpupart.exists():
        pytest.skip("the gpupart console script is not installed next to this interpreter")
    done = subprocess.run(
        [str(gpupart), "simulate", "--json", "--policy", "bestfit"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"] == "bestfit"


def test_mig_mode_reports_accepted_requests_against_a_lower_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--mig", "--load", "0.8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["accepted_pods"] + data["rejected_pods"] == data["arrived_pods"]
    assert data["lower_bound_gpus"] <= data["gpus_used"] <= data["gpus"]
    assert all(name[0] in "1234567" for name in data["profiles"])


def test_mig_mode_takes_no_trace(
    trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = trace
    assert main(["simulate", "--mig", "--nodes", str(nodes), "--pods", str(pods)]) == 2
    assert "--mig runs the built-in example" in capsys.readouterr().err


TIMED_PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
    "deletion_time,scheduled_time\n"
    "a,1000,1024,1,1000,,LS,Running,0,100,0\n"
    "b,1000,1024,1,460,,BE,Running,10,50,10\n"
    "c,1000,1024,2,1000,,LS,Running,20,30,20\n"
)


def test_mig_dynamic_replays_a_trace_with_times_and_states_the_latencies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,T4\n")
    pods.write_text(TIMED_PODS)
    argv = ["simulate", "--mig", "--dynamic", "--nodes", str(nodes), "--pods", str(pods)]
    assert main([*argv, "--policy", "gpupart,hami", "--json", "--create-s", "2"]) == 0
    data = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert data["latencies_s"]["create"] == 2.0 and data["gpus"] == 2 and data["pods"] == 3
    assert set(data["policies"]) == {"gpupart", "hami"}
    ours = data["policies"]["gpupart"]
    # a (7g) and b (3g) bind after create + advertise; c (2 x 7g) waits for a GPU a holds
    assert ours["served"] == 3 and ours["disruptions"] == 0 and ours["bind_p50_s"] == 2.2
    assert main([*argv, "--policy", "gpupart"]) == 0
    out = capsys.readouterr().out
    assert "latencies: create 1 s, destroy 0.5 s, advertise 0.2 s" in out
    assert "\ngpupart " in out


def test_mig_dynamic_refuses_an_unknown_policy_and_dynamic_without_mig(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--dynamic"]) == 2
    assert "--dynamic needs --mig" in capsys.readouterr().err
    assert main(["simulate", "--mig", "--dynamic", "--policy", "magic"]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err


def _simulate(*args: str) -> subprocess.CompletedProcess[str]:
    """`gpupart simulate` as a user runs it: the installed command, stderr not a terminal."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("gpupart")), "simulate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mig", "--plot", "x.png"],
            "--plot does not apply to --mig, which takes --seed, --load, --json",
        ),
        (
            ["--mig", "--max-pods", "5"],
            "--max-pods does not apply to --mig, which takes --seed, --load, --json",
        ),
        (
            ["--mig", "--dynamic", "--plot", "x.png"],
            "--plot does not apply to --mig --dynamic, "
            "which takes --nodes, --pods, --policy, --seed, --json, --gpu-model, --max-pods, "
            "--create-s, --destroy-s, --advertise-s, --plugin-restart-s",
        ),
        (
            ["--mig", "--dynamic", "--load", "0"],
            "--load does not apply to --mig --dynamic, which "
            "takes --nodes, --pods, --policy, --seed, --json, --gpu-model, --max-pods, --create-s, "
            "--destroy-s, --advertise-s, --plugin-restart-s",
        ),
        (
            ["--max-pods", "5"],
            "--max-pods does not apply to a replay without --mig, which takes "
            "--nodes, --pods, --policy, --seed, --load, --tie-break, --json, --plot",
        ),
        (
            ["--create-s", "2"],
            "--create-s does not apply to a replay without --mig, which takes "
            "--nodes, --pods, --policy, --seed, --load, --tie-break, --json, --plot",
        ),
        (
            ["--mig", "--policy", "fgd"],
            "--policy does not apply to --mig, which takes --seed, --load, --json",
        ),
        (
            ["--mig", "--dynamic", "--gpu-model", "H100-SXM5-80GB"],
            "--gpu-model names the products of a trace's nodes: give --nodes/--pods",
        ),
        (["--mig", "--dynamic", "--max-pods", "0"], "--max-pods must be 1 or more, got 0"),
    ],
)
def test_a_flag_the_mode_does_not_read_is_refused(args: list[str], message: str) -> None:
    done = _simulate(*args)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"gpupart simulate: error: {message}\n"


def test_max_pods_cuts_the_built_in_dynamic_workload() -> None:
    done = _simulate("--mig", "--dynamic", "--policy", "gpupart", "--max-pods", "40", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["pods"] == 40 and data["policies"]["gpupart"]["pods"] == 40


def test_the_example_table_explains_every_column_and_ranks_the_policies() -> None:
    done = _simulate()
    assert done.returncode == 0 and done.stderr == ""  # a short run prints no progress
    out = done.stdout
    header = out.splitlines()[3].split()
    assert header == ["policy", "at", "100", "%", "at", "end", "GPUs", "pods", "GPUs", "(%)", "(s)"]
    for column in ("GPUs allocated:", "free GPUs:", "failed pods:", "fragmented GPUs:"):
        assert f"\n{column} " in out, column
    rows = {line.split()[0]: line.split() for line in out.splitlines()[4:8]}
    end = {policy: float(row[2]) for policy, row in rows.items()}
    ranking = out.split("In this run, GPUs allocated at the end: ")[1].splitlines()[0]
    assert ranking == (
        f"gpupart {end['gpupart'] - end['fgd']:+.2f} points over fgd; "
        f"fgd {end['fgd'] - end['bestfit']:+.2f} points over bestfit."
    )
    assert end["gpupart"] > end["fgd"] > end["bestfit"] > end["random"]


def test_readme_shows_the_demo_as_it_runs() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    shown = readme.split("<!-- demo:begin -->\n```console\n$ make demo\n", 1)[1]
    shown = shown.split("```\n<!-- demo:end -->", 1)[0]
    # everything but the run times (last column of the four policy rows)
    strip = re.compile(r" +\d+\.\d\d$", re.MULTILINE)
    assert strip.sub("", shown) == strip.sub("", _simulate().stdout)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_off_a_terminal_is_a_line_every_few_seconds_never_one_per_pod() -> None:
    stream = io.StringIO()  # not a terminal
    clock = _Clock()
    progress = Progress(stream, "fgd", "pods", clock=clock)
    for done, at in (
        (256, 100.5),
        (512, 101.5),
        (768, 104.9),
        (1024, 105.2),
        (1280, 106.0),
        (1536, 110.3),
        (2048, 112.0),
    ):
        clock.now = at
        progress.update(done, 2048)
    progress.close()
    assert stream.getvalue() == (
        "gpupart simulate: fgd: 50% (1,024 of 2,048 pods), 5 s\n"
        "gpupart simulate: fgd: 75% (1,536 of 2,048 pods), 10 s\n"
        "gpupart simulate: fgd: done in 12.0 s\n"
    )


def test_progress_of_a_short_run_is_silent() -> None:
    stream = io.StringIO()
    clock = _Clock()
    progress = Progress(stream, "fgd", "pods", clock=clock)
    clock.now = 100.9
    progress.update(100, 100)
    progress.close()
    assert stream.getvalue() == ""
