"""plan.py, the planner: its command line (each script's own flags and one-line refusals, --json). Its figures are
checked elsewhere, against what runs measure: the model state after every run the suite makes (tests/runs.py's
check_plan, called by conftest.launch too), the bytes of each collective in the ledgers of test_fsdp.py,
test_zero3.py, test_tp.py, test_cp.py, test_pp.py, test_hybrid.py and test_ep.py, a block's saved activations in
test_recompute.py."""
import itertools
import json
import re

import pytest

import plan
import plan_report
from test_parity import MEMORY_FLAGS, MEMORY_RUNS, launch_group, memory_args

LAYOUTS = {  # a layout each script accepts at 4 ranks, with the flags that make it one
    "ddp_train.py": [], "ddp_diloco_train.py": [], "fsdp_train.py": [], "fsdp_hsdp_train.py": ["--replicate_size", "2"],
    "zero3_train.py": ["--stage", "2"], "zero3_tuning_train.py": [],
    "tp_train.py": ["--tensor_parallel_size", "2", "--sequence_parallel"], "tp_overlap_train.py": [],
    "cp_train.py": ["--context_parallel_size", "2"], "pp_train.py": ["--schedule", "interleaved", "--n_layer", "8"],
    "pp_vocab_train.py": [], "pp_zb_train.py": ["--schedule", "zbv", "--n_layer", "8"],
    "ep_train.py": ["--data_parallel_size", "2"],
    "hybrid_train.py": ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2"],
}


@pytest.mark.parametrize("script", list(plan.PLANS))
def test_every_script_plans_every_rank(script, capsys):
    assert set(LAYOUTS) == set(plan.PLANS)
    assert plan_report.main(["--nproc_per_node", "4", "--json", script, *LAYOUTS[script]]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert sorted(r for rank in ranks for r in rank["ranks"]) == [0, 1, 2, 3]  # each rank once
    for rank in ranks:
        assert rank["model_state"] == rank["params"] + rank["grads"] + rank["optimizer"] > 0
        assert all(value > 0 for value in rank["comm"].values()) and rank["comm"], rank
    assert plan_report.main(["--nproc_per_node", "4", script, *LAYOUTS[script]]) == 0
    assert "model state" in capsys.readouterr().out


def test_bad_input_is_the_scripts_own_line(capsys):
    with pytest.raises(SystemExit) as stop:
        plan_report.main(["--nproc_per_node", "3", "tp_train.py"])
    assert stop.value.code not in (0, None)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --n_head: 4 must be divisible by --tensor_parallel_size (3)")


def test_bytes_between_nodes_are_those_of_groups_that_span_nodes():
    """--nnodes: a collective's bytes cross nodes when its group has ranks on another node (consecutive ranks a
    node, as torchrun numbers them); a pipeline's send only where a neighbouring stage is on another node."""
    def between(script, nproc, nnodes, *flags):
        ranks = plan.plan(script, nproc * nnodes, list(flags), nproc)
        return {r: {key: (rank.comm[key], rank.between[key]) for key in rank.comm}
                for rank in ranks for r in rank.ranks}
    tp = between("tp_train.py", 4, 2, "--tensor_parallel_size", "4", "--data_parallel_size", "2")
    for r in range(8):  # the TP group is a node, the DP pair spans two
        assert tp[r]["all_reduce@tp"][1] == 0 and tp[r]["all_reduce@dp"][1] == tp[r]["all_reduce@dp"][0] > 0
    ddp = between("ddp_train.py", 2, 2)
    assert all(nbytes == crossing > 0 for rank in ddp.values() for nbytes, crossing in rank.values())
    assert all(crossing == 0 for rank in between("ddp_train.py", 4, 1).values() for _, crossing in rank.values())
    pp = between("pp_train.py", 2, 2, "--n_layer", "4")  # stages 0 1 | 2 3: the pair 1-2 crosses
    assert [pp[r]["send@pp"][1] for r in range(4)] == [0, pp[1]["send@pp"][0] // 2, pp[2]["send@pp"][0] // 2, 0]
    assert pp[0]["all_reduce@tied"] == pp[3]["all_reduce@tied"] == (pp[0]["all_reduce@tied"][0],) * 2  # 0 with 3
    hybrid = between("hybrid_train.py", 4, 2, "--pipeline_parallel_size", "2", "--tensor_parallel_size", "2",
                     "--n_layer", "4")  # (dp, pp, tp): a node holds one dp replica's two stages
    assert all(rank["all_reduce@dpxcp"][1] > 0 and rank["all_reduce@tp"][1] == rank["send@pp"][1] == 0
               for rank in hybrid.values())


def test_activations_are_printed_with_the_most_in_flight(capsys):
    """1F1B at 2 ranks and 4 micro-batches: rank 0 holds 2 micro-batches at its peak (warm-up p - r), rank 1 one."""
    ranks = plan.plan("pp_train.py", 2, ["--n_layer", "4", "--n_microbatches", "4", "--schedule", "1f1b"])
    assert [rank.peak_activations // rank.activations for rank in ranks] == [2, 1]
    assert plan_report.main(["--nproc_per_node", "2", "--nnodes", "2", "ddp_train.py"]) == 0
    out = capsys.readouterr().out
    assert "at the most in flight" in out and "between nodes" in out


def test_gpu_time_is_compute_at_the_efficiency_plus_what_is_not_hidden(capsys):
    """--gpu: one rank computes at the stated share of peak (MFU = it, recompute aside); tp's all-reduces are on
    the critical path, each 2(n-1)/n of its bytes at NVLink's bandwidth; an unknown GPU is one line."""
    argv = ["--json", "--gpu", "h100", "--efficiency", "0.4", "ddp_train.py", "--dtype", "bfloat16"]
    assert plan_report.main(argv) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    assert estimate["mfu"] == pytest.approx(0.4) and estimate["fits"]
    flags = ["--tensor_parallel_size", "2", "--dtype", "bfloat16"]
    assert plan_report.main(["--json", "--nproc_per_node", "2", "--gpu", "a100", "tp_train.py", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    (rank,), peak, _, nvlink, _ = out["ranks"], *plan_report.GPUS["a100"]
    comm = sum(2 * (2 - 1) / 2 * nbytes / nvlink for nbytes in rank["comm"].values())  # all all-reduces
    assert set(key.split("@")[0] for key in rank["comm"]) == {"all_reduce"}
    assert out["estimate"]["step_s"] == pytest.approx(rank["flops"][1] / (peak * 0.5) + comm)
    with pytest.raises(SystemExit) as stop:
        plan_report.main(["--gpu", "tpu", "ddp_train.py"])
    assert stop.value.code == 2 and "--gpu: invalid choice: 'tpu'" in capsys.readouterr().err


SEARCH = ["--search", "--nproc_per_node", "2", "--nnodes", "2", "--gpu", "tiny", "--global_batch_tokens", "4096"]


@pytest.fixture
def tiny_gpu(monkeypatch):
    """A GPU of 80 MiB, so that at the small preset some layouts need checkpointing or accumulation and some fit in
    no variant, whose links are slow beside its compute, so that a mode that recomputes more can win by taking fewer
    micro-steps."""
    monkeypatch.setitem(plan_report.GPUS, "tiny", (1e14, 80 * 2**20, 1e9, 1e8))


def test_the_search_finds_what_planning_every_variant_finds(tiny_gpu, capsys):
    """--search prunes (in each mode the first variant that fits is its best; a mode that fits at its first variant
    ends the layout): every variant of every layout planned here, with no pruning, ranks the same best layouts with
    the same times; every printed command is one the script accepts, and plans to the printed time; the counts add
    up."""
    import plan_search
    assert plan_report.main([*SEARCH, "--top", "100"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split()[1:] for line in out if re.match(r" ?\d+ +[\d,.]+ +[\d,]+ +[\d.]+%", line)]
    commands = [line.split(" 2 ", 1)[1].split() for line in out if line.startswith("   torchrun")]
    everything, config = [], plan.gpt_config(plan_report.script_args("ddp_train.py", [], 1))
    batch = 4096 // config.block_size
    for script, flags, stages, replicas in plan_search.layouts(4, config):
        for (m, mode), (i, (flag, n)) in itertools.product(enumerate(plan_search.MODES),
                                                           enumerate(plan_search.variants(batch // replicas, stages))):
            argv = ["--dtype", "bfloat16", "--batch_size", str(batch), *(flags or []), flag, str(n),
                    "--activation_checkpointing", mode]
            args, _ = plan_search.parse(script, argv, {}, 4)
            if flags is None or args is None:
                continue
            estimate = plan_report.estimate_step(script, args, plan.plan(script, 4, argv, 2, args=args), "tiny", 0.5, 4)
            if estimate["fits"]:
                everything.append(((estimate["step_s"], i, m), estimate["memory"], script, " ".join(flags)))
    best = {}  # a layout's: the least time; on ties the fewest micro-steps (most micro-batches), the least recompute
    for (seconds, _, _), memory, script, flags in sorted(everything):
        best.setdefault((script, flags), (seconds, memory))
    expected = [[f"{seconds * 1e3:,.1f}", *plan_report.human(memory).split()]
                for seconds, memory in sorted(best.values())]
    assert len(rows) == len(commands) == len(expected) > 10
    assert [[row[0], *row[-2:]] for row in rows] == expected  # each layout's time and memory
    for command in commands[:3]:  # the first three again, each as its own plan
        assert plan_report.main(["--json", "--nproc_per_node", "2", "--nnodes", "2", "--gpu", "tiny", *command]) == 0
        estimate = json.loads(capsys.readouterr().out)["estimate"]
        assert f"{estimate['step_s'] * 1e3:,.1f}" == rows[commands.index(command)][0]
    counts = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:layouts|fit|that)", out[-1])]
    assert counts[0] == sum(counts[1:]) and counts[2] > 0, out[-1]  # and some fit in no variant


def test_the_search_refuses_what_it_cannot_search_in_one_line(capsys):
    """The search chooses every flag but the model's: another is one line; so is a batch the block size does not
    divide, and a missing --gpu."""
    for argv, line in [(["--batch_size", "8"], "--batch_size: not a model flag"),
                       (["--global_batch_tokens", "1000"], "--global_batch_tokens: 1000 must be divisible by"),
                       (["--n_head", "5"], "--n_head: n_embd (128) must be divisible by n_head (5)")]:
        with pytest.raises(SystemExit) as stop:
            plan_report.main(["--search", "--gpu", "h100", "--global_batch_tokens", "4096", *argv])
        assert stop.value.code not in (0, None)
        said = capsys.readouterr().err.strip().splitlines()[-1:] or [stop.value.code]  # a SystemExit's line: its code
        assert line in said[0], said
    with pytest.raises(SystemExit):
        plan_report.main(["--search", "--global_batch_tokens", "4096"])
    assert "--gpu" in capsys.readouterr().err


@pytest.mark.parametrize("script,flags,tolerance", MEMORY_RUNS, ids=[f"{s} {' '.join(f)}" for s, f, _ in MEMORY_RUNS])
def test_a_steps_peak_on_the_device_is_the_plans(script, flags, tolerance, shared_run):
    """plan.Rank.memory, each rank's peak in a step, against the peak of a run's second step on a modelled GPU
    (tests/runs.py: conftest.DeviceMemory over the whole run, CUDA's loss path), rank by rank; a run the plan says
    is measured (plan_report.peak_measured; FSDP2's, DTensor's and torch's pipelines' are not)."""
    assert plan_report.peak_measured(script, plan_report.script_args(script, MEMORY_FLAGS + flags, 2))
    shared_run.batch(2, launch_group(2))
    out_dir, _ = shared_run(script, 2, memory_args(flags))
    planned = plan_report.per_rank(plan.plan(script, 2, MEMORY_FLAGS + flags), 2, "memory")
    for rank, bytes_planned in enumerate(planned):
        with open(out_dir / f"memory_rank{rank}.json") as f:
            measured = json.load(f)["step_peak"]
        assert abs(bytes_planned - measured) <= tolerance, (rank, bytes_planned, measured, bytes_planned - measured)
