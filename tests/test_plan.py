"""plan.py, the planner: its command line (each script's own flags and one-line refusals, --json). Its figures are
checked elsewhere, against what runs measure: the model state after every run the suite makes (tests/runs.py's
check_plan, called by conftest.launch too), the bytes of each collective in the ledgers of test_fsdp.py,
test_zero3.py, test_tp.py, test_cp.py, test_pp.py, test_hybrid.py and test_ep.py, a block's saved activations in
test_recompute.py."""
import json

import pytest

import plan

LAYOUTS = {  # a layout each script accepts at 4 ranks, with the flags that make it one
    "ddp_train.py": [], "fsdp_train.py": [], "zero3_train.py": ["--stage", "2"], "zero3_tuning_train.py": [],
    "tp_train.py": ["--tensor_parallel_size", "2", "--sequence_parallel"], "tp_overlap_train.py": [],
    "cp_train.py": ["--context_parallel_size", "2"], "pp_train.py": ["--schedule", "interleaved", "--n_layer", "8"],
    "pp_vocab_train.py": [], "pp_zb_train.py": ["--schedule", "zbv", "--n_layer", "8"],
    "ep_train.py": ["--data_parallel_size", "2"],
    "hybrid_train.py": ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2"],
}


@pytest.mark.parametrize("script", list(plan.PLANS))
def test_every_script_plans_every_rank(script, capsys):
    assert set(LAYOUTS) == set(plan.PLANS)
    assert plan.main(["--nproc_per_node", "4", "--json", script, *LAYOUTS[script]]) == 0
    ranks = json.loads(capsys.readouterr().out)
    assert sorted(r for rank in ranks for r in rank["ranks"]) == [0, 1, 2, 3]  # each rank once
    for rank in ranks:
        assert rank["model_state"] == rank["params"] + rank["grads"] + rank["optimizer"] > 0
        assert all(value > 0 for value in rank["comm"].values()) and rank["comm"], rank
    assert plan.main(["--nproc_per_node", "4", script, *LAYOUTS[script]]) == 0
    assert "model state" in capsys.readouterr().out


def test_bad_input_is_the_scripts_own_line(capsys):
    with pytest.raises(SystemExit) as stop:
        plan.main(["--nproc_per_node", "3", "tp_train.py"])
    assert stop.value.code not in (0, None)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --n_head: 4 must be divisible by --tensor_parallel_size (3)")
