"""ep_train.py and the mixture of experts in common/model.py: expert parallelism equals one process.

The reference is one process, `ep_train.py --n_experts 4` (EP 1: every expert local); the MoE layer itself, one
process's and EP 2's, is checked against one written here a token at a time. The runs go through each script's
real main() in spawned gloo ranks, several runs a spawn (starting ranks is the slow part): one process (the
references), 2 ranks (EP 2 and its torch DDP peer with accumulation, bf16, a forced router, a cut and its resume,
activation checkpointing, and the strategy's pieces called directly), 4 ranks (EP 4 and EP 2 x DP 2 with
accumulation). Tolerances are tests/test_parity.py's: TOL on every loss, aux loss and evaluation, NORM_TOL relative
on the pre-clip grad norm; bf16 is compared with the fp32 reference at tests/test_bf16.py's TOL.
"""
import copy
import os
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import common.model
import ep_train
import plan
import plan_report
from conftest import PARITY, TINY, paired, read_metrics, refusal, spawn, worst
from common.config import gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast
from common.metrics import model_state_bytes
from common.model import GPT, GPTConfig, MoE, load_balance_loss, route, run_experts
from ep_train import EP, ExpertParallel, GroupedExperts, add_ep_flags

TOL, NORM_TOL, BF16_TOL = 1e-5, 1e-6, 5e-3  # tests/test_parity.py's and tests/test_bf16.py's
STEPS, CUT, SHORT = 15, 6, 10  # SHORT: the runs that need fewer steps (the schedule pinned to STEPS' as it is)
MOE = ["--n_experts", "4", "--top_k", "2"]
FLAGS = PARITY + MOE + ["--max_iters", str(STEPS)]
ACCUM = ["--grad_accum_steps", "2"]
SHORTER = ["--max_iters", str(SHORT), "--lr_decay_iters", str(STEPS), "--eval_interval", "0"]
AC_STEPS = 2  # activation checkpointing's runs: a step, and one on the weights it updated
AC = ACCUM + ["--max_iters", str(AC_STEPS), "--lr_decay_iters", str(STEPS), "--eval_interval", "0"]
FULL, DROPOUT = ["--activation_checkpointing", "full"], ["--dropout", "0.1"]


def forced_route(probs, k):
    """Every token to experts 0..k-1 (all on EP rank 0 at E = 4, EP = 2), with gates as route gives them (renormalised
    from k = 2, the probability itself at k = 1): the router still learns through them."""
    gates = probs[..., :k]
    experts = torch.arange(k).expand(gates.shape).contiguous()
    return gates / gates.sum(dim=-1, keepdim=True) if k > 1 else gates, experts


def _main(script, argv, forced=False):
    """script's main(argv) in this spawned rank (its process group already made); returns, per training forward of
    each MoE layer, the rows this rank's experts computed (ep_train.GroupedExperts.forward, wrapped)."""
    rows = []
    original_route, original_forward = common.model.route, GroupedExperts.forward

    def counting_forward(self, received, *args):
        if torch.is_grad_enabled():  # a training forward, not an evaluation
            rows.append(received.size(0))
        return original_forward(self, received, *args)

    GroupedExperts.forward = counting_forward
    if forced:
        common.model.route = forced_route
    try:
        ep_train.main(argv)
    finally:
        common.model.route, GroupedExperts.forward = original_route, original_forward
    return rows


def _runs(rank, world_size, runs, checks=False):
    """Each (script, argv, forced) of runs, in turn; with checks, the 2-rank checks of the strategy's pieces too."""
    for key, value in dict(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size).items():
        os.environ[key] = str(value)
    out = {"rows": [_main(*run) for run in runs]}
    if world_size < 4:
        out["syncs"] = _host_syncs(rank, world_size)
    if checks:
        out.update(identity=_identity(rank, world_size), ledger=_ledger(rank, world_size),
                   per_token=_per_token_ep(rank, world_size), order=_collective_order(rank, world_size))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (out_dir, [rows per training forward per MoE layer, by rank])} of every run of this file."""
    root = tmp_path_factory.mktemp("ep")
    cut = ["--resume_from", str(root / "ep2-cut" / "ckpt.pt")]
    plan = {
        1: [("reference", "ep", [], False), ("reference-forced", "ep", SHORTER, True),
            ("one-resumed", "ep", SHORTER + cut, False)],
        2: [("ep2", "ep", ACCUM, False), ("ep2-pytorch", "ep", ACCUM + ["--implementation", "pytorch"], False),
            ("ep2-bf16", "ep", SHORTER + ["--dtype", "bfloat16"], False), ("ep2-forced", "ep", SHORTER, True),
            ("ep2-pytorch-forced", "ep", SHORTER + ["--implementation", "pytorch"], True),
            ("ep2-cut", "ep", ACCUM + ["--max_iters", str(CUT), "--lr_decay_iters", str(STEPS)], False),
            ("ep2-resumed", "ep", ACCUM + SHORTER + cut, False), ("ep2-ac", "ep", AC + FULL, False),
            ("ep2-dropout", "ep", AC + DROPOUT, False), ("ep2-dropout-ac", "ep", AC + DROPOUT + FULL, False),
            ("ep2-dropout-selective", "ep", AC + DROPOUT + ["--activation_checkpointing", "selective"], False),
            ("ep2-pytorch-dropout", "ep", AC + DROPOUT + ["--implementation", "pytorch"], False),
            ("ep2-pytorch-dropout-ac", "ep", AC + DROPOUT + FULL + ["--implementation", "pytorch"], False)],
        4: [("ep4", "ep", ACCUM, False), ("ep2xdp2", "ep", ACCUM + ["--data_parallel_size", "2"], False)],
    }
    found = {}
    for nproc in (2, 1, 4):  # the cut before the single process resumes it
        runs = [(script, FLAGS + extra + ["--out_dir", str(root / name)], forced)
                for name, script, extra, forced in plan[nproc]]
        started = time.time()
        ranks = spawn(_runs, nproc, runs, nproc == 2)
        print(f"{nproc} rank(s): {len(runs)} runs in {time.time() - started:.1f} s")
        for k, (name, *_) in enumerate(plan[nproc]):
            found[name] = root / name, [r["rows"][k] for r in ranks]
        found[f"checks{nproc}"] = ranks
    return found


def record(out_dir):
    rows = read_metrics(out_dir)
    steps = [r for r in rows if "loss" in r]
    return dict(loss=[r["loss"] for r in steps], aux=[r["aux_loss"] for r in steps],
                norm=[r["grad_norm"] for r in steps], eval={r["step"]: (r["train_loss"], r["val_loss"])
                                                            for r in rows if "val_loss" in r})


def differences(run, ref, first=0, last=None):
    """The largest |dloss| over losses, aux losses and evaluations, and the largest relative |dnorm|: the run's steps
    being ref's first..last-1 (`last`: ref's end), as many, each evaluation compared with ref's at its step, which must
    exist; a NaN or inf on either side fails (conftest.paired, worst)."""
    pairs = paired(run["loss"], ref["loss"][first:last], "loss") + paired(run["aux"], ref["aux"][first:last], "aux")
    for step, mine in run["eval"].items():
        assert step in ref["eval"], f"the reference has no evaluation at step {step}: {sorted(ref['eval'])}"
        pairs += paired(mine, ref["eval"][step], f"evaluation at step {step}")
    norms = paired(run["norm"], ref["norm"][first:last], "grad_norm")
    return worst(abs(a - b) for a, b in pairs), worst(abs(a - b) / b for a, b in norms)


@pytest.mark.parametrize("name", ["ep2", "ep2-pytorch", "ep4", "ep2xdp2", "ep2-forced", "ep2-pytorch-forced"])
def test_parity_with_one_process(name, runs):
    """Loss, aux loss, evaluations and pre-clip grad norm of every step equal one process's (accumulation: 2
    micro-steps; forced: every token to experts 0 and 1, both on rank 0)."""
    reference = record(runs["reference-forced" if "forced" in name else "reference"][0])
    run = record(runs[name][0])
    dloss, dnorm = differences(run, reference)
    print(f"{name}: max |dloss| {dloss:.2e}, max rel |dnorm| {dnorm:.2e}")
    steps = SHORT if "forced" in name else STEPS
    assert len(run["loss"]) == steps and sorted(run["eval"]) == ([] if "forced" in name else [0, STEPS])
    assert dloss <= TOL and dnorm <= NORM_TOL
    assert run["loss"][-1] < run["loss"][0] - 0.3, "it trains"
    assert min(reference["norm"]) > 1.0, "every step clips: a gradient off by a factor shows in its norm"


def test_aux_loss_is_logged_before_its_coefficient_as_e_sum_f_p(runs):
    """Step 0's logged aux loss is E sum_i f_i P_i of each sequence, averaged over the sequences and the layers,
    computed here from one process's router probabilities and choices for the same batch and initial weights. Not 1
    by construction: the initial router is nearly uniform (P_i near 1/E), but the load is not balanced."""
    E, k = 4, 2
    routing, probs = _one_process_routing()
    values = []
    for experts, p in zip(routing, probs):  # per layer: (8, 32, k), (8, 32, E)
        for s in range(p.size(0)):
            f = torch.bincount(experts[s].flatten(), minlength=E) / (p.size(1) * k)
            values.append(E * (f * p[s].mean(dim=0)).sum())
    expected = torch.stack(values).mean().item()
    logged = record(runs["reference"][0])["aux"][0]
    print(f"aux at step 0: logged {logged:.6f}, E sum f P {expected:.6f}")
    assert abs(logged - expected) <= TOL and abs(expected - 1) > 1000 * TOL


def test_forced_router_sends_every_row_to_rank_0(runs):
    """Rank 1 holds experts 2 and 3, which no token chose: it receives 0 rows at every layer of every step (the most
    uneven split), and still runs its experts on them."""
    rank0, rank1 = runs["ep2-forced"][1]
    assert len(rank0) == len(rank1) == 2 * SHORT  # 2 layers
    assert all(r == 8 * 32 * 2 for r in rank0) and set(rank1) == {0}  # B*T*k rows, all on rank 0


def test_each_rank_computes_the_rows_one_process_routes_to_its_experts(runs):
    """At every MoE forward of step 0 (the initial weights, which one process routes as the run does), rank r's
    experts compute the EP group's slots that one process's routing of the same batch sends to experts 2r and 2r+1;
    over the run, routing spreads the rows (neither rank gets all)."""
    routing, _ = _one_process_routing()
    per_rank = runs["ep2"][1]  # per rank: [micro-step 0 layer 0, layer 1, micro-step 1 layer 0, ...]
    for rank, rows in enumerate(per_rank):
        assert len(rows) == STEPS * 2 * 2  # steps x micro-steps x layers
        assert rows[:4] == received_at_step_0(routing, rank), (rank, rows[:4])
    assert all(0 < sum(rows) < sum(map(sum, per_rank)) for rows in per_rank)


def received_at_step_0(routing, rank):
    """The rows EP 2's rank `rank` (experts 2r and 2r+1) computes at each MoE forward of step 0 (micro-step j of 2, then
    layer), from one process's routing of the global batch (per layer (8, 32, k))."""
    found = []
    for j in range(2):  # micro-step j: rows [2j, 2j+2) of each rank's 4
        rows = [s * 4 + 2 * j + i for s in range(2) for i in range(2)]  # both ranks' rows of it
        found += [((experts[rows] // 2) == rank).sum().item() for experts in routing]
    return found


def test_bf16_tracks_fp32(runs):
    """Its rows cross the all-to-alls in bf16 (test_all_to_all_bytes_match_the_formula), its gates and aux loss stay
    fp32."""
    fp32, run = record(runs["reference"][0]), record(runs["ep2-bf16"][0])
    assert len(run["loss"]) == SHORT
    dloss = worst(abs(a - b) for a, b in paired(run["loss"] + run["aux"], fp32["loss"][:SHORT] + fp32["aux"][:SHORT],
                                                "bf16 losses and aux losses"))
    print(f"ep2 bf16: max |dloss| against fp32 {dloss:.2e}")
    assert dloss <= BF16_TOL


def test_resume_is_bit_exact_and_the_checkpoint_is_one_process_layout(runs):
    """EP 2 cut at step CUT and resumed equals the run that was not cut, bit for bit; the same checkpoint resumed by
    one process (every expert) continues as one process does."""
    whole, resumed = record(runs["ep2"][0]), record(runs["ep2-resumed"][0])
    assert len(resumed["loss"]) == SHORT - CUT
    assert resumed["loss"] == whole["loss"][CUT:SHORT] and resumed["norm"] == whole["norm"][CUT:SHORT]
    assert resumed["aux"] == whole["aux"][CUT:SHORT]
    ckpt = torch.load(runs["ep2-cut"][0] / "ckpt.pt", weights_only=True)
    config = GPTConfig(**ckpt["config"])
    assert (config.n_experts, config.top_k, config.expert_hidden) == (4, 2, 128)
    assert set(ckpt["model"]) == set(GPT(config, device="meta").state_dict())
    assert set(ckpt["optimizer"]) == {n for n, _ in GPT(config, device="meta").named_parameters()}
    dloss, dnorm = differences(record(runs["one-resumed"][0]), record(runs["reference"][0]), first=CUT, last=SHORT)
    assert dloss <= TOL and dnorm <= NORM_TOL


def test_activation_checkpointing_is_bit_identical(runs):
    """--activation_checkpointing full runs each block again in backward, its all-to-alls with it: losses, aux losses
    and grad norms equal those of the run without, bit for bit (dropout 0: ep2's first steps; dropout 0.1: the masks
    drawn again are the same), custom and torch DDP; so does selective (custom, dropout 0.1). The custom full runs'
    experts ran twice a layer and micro-step: forward, then the recompute in backward (layer 1 first)."""
    def steps(name, last=AC_STEPS):
        found = record(runs[name][0])
        return [found[key][:last] for key in ("loss", "aux", "norm")]

    assert steps("ep2-ac") == steps("ep2") and len(steps("ep2-ac", None)[0]) == AC_STEPS
    assert steps("ep2-dropout-ac") == steps("ep2-dropout-selective") == steps("ep2-dropout") != steps("ep2-ac")
    assert steps("ep2-pytorch-dropout-ac") == steps("ep2-pytorch-dropout")
    assert runs["ep2-dropout-selective"][1] == runs["ep2-dropout"][1]  # selective recomputes attention only
    for name, plain in (("ep2-ac", "ep2"), ("ep2-dropout-ac", "ep2-dropout")):
        for rows, once in zip(runs[name][1], runs[plain][1]):
            forward = once[:AC_STEPS * 2 * 2]  # per micro-step: layer 0, layer 1
            assert rows == [n for j in range(0, len(forward), 2) for n in forward[j:j + 2] + forward[j:j + 2][::-1]]


def test_sample_reads_a_mixture_of_experts_checkpoint(runs, capsys):
    import sample
    sample.main(["--out_dir", str(runs["ep2"][0]), "--num_samples", "1", "--max_new_tokens", "4", "--device", "cpu"])
    assert "---------------" in capsys.readouterr().out


# ---- the strategy's pieces, called directly on 2 ranks (in the runs' 2-rank spawn) ---------------------------

def _identity(rank, world_size):
    """ExpertParallel with identity experts: dispatch then combine returns each row (k = 1, or k = 2 with gates 1
    and 0), or each row twice summed (k = 2, gates 1), bit for bit, for an uneven routing where expert 3 gets no
    row."""
    torch.manual_seed(rank)
    rows = torch.randn(12 + 5 * rank, 8)
    results = []
    for k, gate in ((1, [1.0]), (2, [1.0, 1.0]), (2, [1.0, 0.0])):
        experts = torch.randint(0, 3, (rows.size(0), k))  # 0..2: none for expert 3, on rank 1
        gates = torch.tensor(gate).expand(rows.size(0), k)
        identity = lambda received, expert_of_row, counts, sizes: received  # noqa: E731, the experts' interface
        dispatch = ExpertParallel(identity, SimpleNamespace(n_experts=4, top_k=k), dist.group.WORLD)
        expected = rows * sum(gate)
        results.append(torch.equal(dispatch(rows, experts, gates), expected))
    return results


def test_dispatch_then_combine_returns_the_input_bit_for_bit(runs):
    assert all(all(r["identity"]) for r in runs["checks2"]), [r["identity"] for r in runs["checks2"]]


def _ledger(rank, world_size):
    """One optimizer step of the strategy (2 micro-steps, fp32 and bf16) with dist.all_to_all_single counted: the
    bytes handed to it and their dtype; the expert parameters and AdamW state this rank holds."""
    found = {}
    for dtype in ("float32", "bfloat16"):
        args = parse_args("ep", add_ep_flags, TINY + MOE + ACCUM + ["--dtype", dtype])
        strategy = EP(gpt_config(args), args, torch.device("cpu"))
        optimizer = strategy.configure_optimizer(args)
        sent, chosen, original, original_route = [], [], dist.all_to_all_single, common.model.route

        def counting(output, input, *a, **kw):
            sent.append((input.numel() * input.element_size(), str(input.dtype)))
            return original(output, input, *a, **kw)

        def recording(probs, k):
            gates, experts = original_route(probs, k)
            chosen.append(experts)
            return gates, experts

        dist.all_to_all_single, common.model.route = counting, recording
        try:
            x, y = get_batch("train", 0, 8, 32, 1337)
            mine = slice(rank * 4, rank * 4 + 4)
            for j in range(2):
                strategy.forward_backward(x[mine][2 * j:2 * j + 2], y[mine][2 * j:2 * j + 2], sync=j == 1)
        finally:
            dist.all_to_all_single, common.model.route = original, original_route
        optimizer.step()
        # Each expert's tensors by their one-process names: expert j's rows of this rank's stacked tensors
        expert_tensors = [(name, p[j], optimizer.state[p]) for p, names, stacked in strategy.layout if stacked
                          for j, name in enumerate(names)]
        experts = {name: t.numel() for name, t, _ in expert_tensors}
        state = {name: sorted(s) for name, _, s in expert_tensors}
        assert all(s["exp_avg"].shape == p.shape for p, _, _ in strategy.layout for s in [optimizer.state[p]])
        found[dtype] = sent, experts, state, model_state_bytes(optimizer), chosen
    return found


@contextmanager
def cuda_syncs():
    """Yields the names of the calls, in order, that make the host wait for a CUDA device: the reads back (.item,
    .tolist, .cpu, ...) and the ops whose output's size depends on values, which read them back to size it
    (bincount: its input's min and max; nonzero, unique, masked_select, repeat_interleave without output_size,
    indexing by a boolean mask). On the CPU none waits: wrapped here, they count what CUDA would do."""
    calls, patches = [], []

    def wrap(owner, attr, syncs=lambda *args, **kwargs: True):
        original = getattr(owner, attr)

        def call(*args, **kwargs):
            if syncs(*args, **kwargs):
                calls.append(attr)
            return original(*args, **kwargs)
        patches.append((owner, attr, original))
        setattr(owner, attr, call)

    def sizes_from_values(*args, output_size=None, **kwargs):  # repeat_interleave(input, repeats) or (repeats)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        return isinstance(repeats, torch.Tensor) and output_size is None

    def by_mask(tensor, index):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (index if type(index) is tuple
                                                                                   else (index,)))
    try:
        for owner in (torch, torch.Tensor):
            for attr in ("nonzero", "unique", "masked_select"):
                wrap(owner, attr)
            wrap(owner, "repeat_interleave", sizes_from_values)
        wrap(torch, "bincount")
        wrap(torch.Tensor, "__getitem__", by_mask)
        for attr in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
            wrap(torch.Tensor, attr)
        yield calls
    finally:
        for owner, attr, original in patches:
            setattr(owner, attr, original)


def _host_syncs(rank, world_size):
    """Per --activation_checkpointing none and full: the CUDA syncs (cuda_syncs) of one step's forward_backward calls
    (2 micro-steps, fp32), this rank's rows of the global batch."""
    found = {}
    for mode in ("none", "full"):
        args = parse_args("ep", add_ep_flags, TINY + MOE + ACCUM + ["--activation_checkpointing", mode])
        strategy = EP(gpt_config(args), args, torch.device("cpu"))
        x, y = get_batch("train", 0, 8, 32, 1337)
        micro = 8 // world_size // 2
        with cuda_syncs() as calls:
            for j in range(2):
                part = slice((2 * rank + j) * micro, (2 * rank + j + 1) * micro)
                strategy.forward_backward(x[part], y[part], sync=j == 1)
        found[mode] = calls
    return found


@pytest.mark.parametrize("nproc", [1, 2])
def test_one_host_sync_per_moe_layer_and_micro_step(nproc, runs):
    """At EP 1 and EP 2, with and without --activation_checkpointing full (whose recompute reuses the forward's
    sizes): each MoE layer's forward and backward together wait for the device once a micro-step, the .tolist() of
    the split sizes; counting the ops that sync on CUDA (cuda_syncs), as well as the reads back."""
    for rank, r in enumerate(runs[f"checks{nproc}"]):
        for mode, calls in r["syncs"].items():
            print(f"EP {nproc} rank {rank}, --activation_checkpointing {mode}: {calls}")
            assert calls == ["tolist"] * 2 * 2, (nproc, rank, mode, calls)  # 2 micro-steps x 2 layers


def _collective_order(rank, world_size):
    """One step (2 micro-steps) with buckets of 16 KiB (several: TINY's dense gradients are 13 MB, one bucket at
    the default), the collectives recorded in the order each rank starts them: ("all_to_all",) or ("all_reduce",
    numel); and the pre-clip grad norm, against that of the default buckets."""
    found, original_a2a, original_reduce = {}, dist.all_to_all_single, dist.all_reduce
    for cap in (16 / 1024, ep_train.BUCKET_CAP_MB):
        calls = []

        def all_to_all(*args, **kwargs):
            calls.append(("all_to_all",))
            return original_a2a(*args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):
            calls.append(("all_reduce", tensor.numel()))
            return original_reduce(tensor, *args, **kwargs)

        args = parse_args("ep", add_ep_flags, TINY + MOE + ACCUM)
        default, ep_train.BUCKET_CAP_MB = ep_train.BUCKET_CAP_MB, cap
        try:
            strategy = EP(gpt_config(args), args, torch.device("cpu"))
        finally:
            ep_train.BUCKET_CAP_MB = default
        x, y = get_batch("train", 0, 8, 32, 1337)
        dist.all_to_all_single, dist.all_reduce = all_to_all, all_reduce
        try:
            for j in range(2):
                part = slice((2 * rank + j) * 2, (2 * rank + j + 1) * 2)
                strategy.forward_backward(x[part], y[part], sync=j == 1)
        finally:
            dist.all_to_all_single, dist.all_reduce = original_a2a, original_reduce
        found[cap] = calls, len(strategy.buckets.buckets), strategy.clip_grad_norm_(0).item()
    return found


def test_every_rank_starts_the_all_to_alls_and_the_buckets_in_one_order(runs):
    """The order GradientBuckets' docstring argues: at EP 2, the all-to-alls and the buckets' all-reduces come in the
    same order on both ranks, the buckets during the last micro-step's backward, between its all-to-alls (hidden
    behind the layers' backward that follow), each bucket once; the norm is the default buckets' bit for bit."""
    ranks = [r["order"] for r in runs["checks2"]]
    small, default = 16 / 1024, ep_train.BUCKET_CAP_MB
    calls, n_buckets, norm = ranks[0][small]
    assert all(r[small][0] == calls for r in ranks), "one order on every rank"
    assert n_buckets > 4 and ranks[0][default][1] == 1
    reduces = [i for i, call in enumerate(calls) if call[0] == "all_reduce"]
    assert len(reduces) == n_buckets, "each bucket once, on the syncing micro-step only"
    last_a2a = max(i for i, call in enumerate(calls) if call[0] == "all_to_all")
    assert reduces[0] < last_a2a, "a bucket leaves while backward still has layers to run"
    assert all(r[small][2] == r[default][2] == norm for r in ranks)


def test_expert_load_is_the_worst_layers_max_over_mean_of_the_global_batch(runs):
    """Forced (every token to experts 0 and 1 of 4, k = 2): each of those gets N rows, the others none, max over mean
    2.0, at every step, in one process, EP 2 and torch DDP. Unforced, step 0: the figure one process's routing of the
    global batch gives (the initial weights), at EP 1 and EP 2."""
    for name in ("reference-forced", "ep2-forced", "ep2-pytorch-forced"):
        loads = [r["expert_load"] for r in read_metrics(runs[name][0]) if "loss" in r]
        assert loads == [2.0] * SHORT, (name, loads)
    routing, _ = _one_process_routing()
    counts = [torch.bincount(experts.flatten(), minlength=4).float() for experts in routing]  # per layer (E,)
    expected = max((c.max() / c.mean()).item() for c in counts)
    for name in ("reference", "ep2", "ep4", "ep2xdp2"):
        logged = [r["expert_load"] for r in read_metrics(runs[name][0]) if "loss" in r]
        print(f"{name}: expert_load at step 0 {logged[0]:.4f}, from one process's routing {expected:.4f}")
        assert abs(logged[0] - expected) <= 1e-6 and expected > 1.05


def test_grouped_experts_equal_the_loop_and_an_expert_without_rows_gets_zeros():
    """GroupedExperts (torch._grouped_mm) against common.model's run_experts (a matmul pair an expert, as one
    process runs them) on the same weights, expert 2 of 4 given no row: the output and every gradient within
    MOE_TOL, expert 2's zeros, not None."""
    moe = distinct_moe(2)
    grouped = grouped_experts(moe, [0, 1, 2, 3], True)
    sizes = [5, 3, 0, 7]
    x, w = torch.randn(2, 15, 16, generator=torch.Generator().manual_seed(0))
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    counts = torch.tensor(sizes)
    expert_of_row = torch.arange(4).repeat_interleave(counts, output_size=15)
    y = grouped(inputs[0], expert_of_row, counts, sizes)
    expected = run_experts(moe.experts.values(), inputs[1], sizes)
    (y * w).sum().backward()
    (expected * w).sum().backward()
    pairs = [(y, expected), (inputs[0].grad, inputs[1].grad)] + expert_gradients(grouped, moe)
    print(f"grouped against the loop: worst {largest_relative(pairs):.2e}")
    assert largest_relative(pairs) <= MOE_TOL
    assert all(not p.grad[2].any() for p in grouped.parameters())
    assert all(p.grad[j].any() for p in grouped.parameters() for j in (0, 1, 3))


def _one_process_routing(dtype="float32"):
    """Each layer's experts (B, T, k) and router probabilities (B, T, E) for the global batch of step 0 in one process
    computing in `dtype` (common.model.route recorded): the runs' initial weights (seed 1337) and first batch."""
    args = parse_args("ep", None, TINY + MOE + ["--dtype", dtype])
    model = GPT(gpt_config(args), seed=args.seed)
    chosen, probabilities, original = [], [], common.model.route

    def recording(probs, k):
        gates, experts = original(probs, k)
        chosen.append(experts)
        probabilities.append(probs.detach())
        return gates, experts

    common.model.route = recording
    try:
        with autocast(args, torch.device("cpu")):
            model(*get_batch("train", 0, 8, 32, 1337))
    finally:
        common.model.route = original
    return chosen, probabilities


def test_all_to_all_bytes_match_the_formula(runs):
    """Per MoE layer and micro-step a rank hands all_to_all_single 8E bytes of counts, then 2 (N k + R) C s bytes of
    rows (forward: its N k slots out, its experts' R rows back; backward: the same, swapped), s = 2 in bf16: R from
    one process's routing of the same batch in the same dtype, and each call's bytes in the order the calls come.
    Each rank's routing is one process's, token for token (bf16's differs from fp32's: its residual stream does)."""
    E, C, k, micro, T = 4, 64, 2, 2, 32
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        routing, _ = _one_process_routing(dtype)  # per layer (8, 32, 2)
        for rank, r in enumerate(runs["checks2"]):
            sent, _, _, _, chosen = r["ledger"][dtype]
            out = micro * T * k * C * size  # the N k slots out (forward), their gradients back (backward)
            expected = []
            for j in range(2):  # micro-step j: rows [2j, 2j+2) of each rank's 4
                first, second = (R * C * size for R in received_at_step_0(routing, rank)[2 * j:2 * j + 2])
                expected += [8 * E, out, first, 8 * E, out, second]  # forward, layer 0 then 1: counts, out, back
                expected += [out, second, out, first]  # backward, layer 1 then 0: gradients of back, then of out
            assert [b for b, _ in sent] == expected, (rank, dtype)
            assert {d for _, d in sent} == {"torch.int64", f"torch.{dtype}"}
            mine = [routing[layer][rank * 4 + 2 * j:rank * 4 + 2 * j + 2] for j in range(2) for layer in range(2)]
            assert all(torch.equal(a, b) for a, b in zip(chosen, mine, strict=True)), (rank, dtype)
        # plan.py's figure is balanced routing's (R = N k on every rank): its sum over the EP group is theirs
        balanced = plan.plan("ep_train.py", 2, TINY + MOE + ACCUM + ["--dtype", dtype])[0].comm["all_to_all@ep"]
        assert sum(b for r in runs["checks2"] for b, _ in r["ledger"][dtype][0]) == 2 * balanced, dtype


def test_each_rank_holds_its_experts_and_their_adamw_state_only(runs):
    full = {n: p.numel() for n, p in GPT(gpt_config(parse_args("ep", None, TINY + MOE)), device="meta")
            .named_parameters()}
    expert_numel = sum(v for n, v in full.items() if ".experts." in n)
    planned = plan_report.per_rank(plan.plan("ep_train.py", 2, TINY + MOE + ACCUM), 2, "model_state")  # 16 bytes a number
    held = []
    for rank, r in enumerate(runs["checks2"]):
        _, experts, state, state_bytes, _ = r["ledger"]["float32"]
        assert {n.split(".experts.")[1].split(".")[0] for n in experts} == {str(2 * rank), str(2 * rank + 1)}
        assert all(full[n] == v for n, v in experts.items()) and sum(experts.values()) == expert_numel // 2
        assert all(s == ["exp_avg", "exp_avg_sq", "step"] for s in state.values()) and state.keys() == experts.keys()
        assert state_bytes == planned[rank], (rank, state_bytes, planned[rank])
        held.append(set(experts))
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == {n for n in full if ".experts." in n}


# ---- the model's routing, in one process ----------------------------------------------------------------------

def test_route_breaks_ties_to_the_lower_expert_and_renormalises_from_k_2():
    """k = 2: the gates renormalised; k = 1: the probability itself (Switch Transformer's top-1), not a constant 1."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.3, 0.3, 0.3], [0.4, 0.1, 0.4, 0.1]])
    gates, experts = route(probs, 2)
    assert experts.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert torch.equal(gates, torch.full((3, 2), 0.5))
    gates, experts = route(probs, 1)
    assert experts.tolist() == [[0], [1], [0]]
    assert torch.equal(gates, torch.tensor([[0.25], [0.3], [0.4]]))


def test_aux_loss_is_per_sequence_so_any_split_of_the_batch_gives_its_mean():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 16, 8), dim=-1)
    _, experts = route(probs, 2)
    whole = load_balance_loss(probs, experts)
    halves = (load_balance_loss(probs[:2], experts[:2]) + load_balance_loss(probs[2:], experts[2:])) / 2
    assert torch.allclose(whole, halves, rtol=0, atol=1e-6)
    one = load_balance_loss(probs[:1], experts[:1])
    f = torch.bincount(experts[0].flatten(), minlength=8) / 32
    assert torch.allclose(one, 8 * (f * probs[0].mean(0)).sum(), atol=1e-6)
    uniform = torch.full((1, 16, 8), 1 / 8)  # uniform probabilities: 1 whatever the load (here all on experts 0, 1)
    assert torch.allclose(load_balance_loss(uniform, route(uniform, 2)[1]), torch.tensor(1.0))
    # Worked examples where neither f nor P is uniform (E = 4, k = 2, every token alike): the load on experts 0 and
    # 1, f = (1/2, 1/2, 0, 0), against P = (0.7, 0.2, 0.05, 0.05): 4 (0.35 + 0.1) = 1.8; and P = (1/2, 1/2, 0, 0),
    # every token certain of its two: E/k = 2, the worst.
    for p, expected in (([0.7, 0.2, 0.05, 0.05], 1.8), ([0.5, 0.5, 0.0, 0.0], 2.0)):
        probs = torch.tensor(p).expand(2, 16, 4)
        assert route(probs, 2)[1].unique().tolist() == [0, 1]
        assert torch.allclose(load_balance_loss(probs, route(probs, 2)[1]), torch.tensor(expected))


def test_an_expert_without_rows_gets_a_zero_gradient_not_none(monkeypatch):
    monkeypatch.setattr(common.model, "route", forced_route)
    moe = MoE(GPTConfig(n_embd=16, n_experts=4, top_k=2, expert_hidden=8))
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    moe(torch.randn(2, 5, 16)).sum().backward()
    for i in ("2", "3"):
        assert all(p.grad is not None and not p.grad.any() for p in moe.experts[i].parameters())
    assert all(p.grad.any() for p in moe.experts["0"].parameters())


# ---- the mixture of experts against a reference written a token at a time -----------------------------------------

def distinct_moe(k):
    """A MoE layer of 4 experts, top-k, the experts' weights drawn N(0, 1) (experts that differ), the router's N(0, 0.1)
    (probabilities from about 0.1 to 0.8: no gate near 0 or 1 to hide a wrong one); the same values on every rank."""
    moe = MoE(GPTConfig(n_embd=16, n_experts=4, top_k=k, expert_hidden=8))
    generator = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(std=0.1 if name == "router.weight" else 1.0, generator=generator)
    return moe


def per_token_moe(moe, x):
    """The MoE layer one token at a time, written without common.model's route, sorts or combine:
    y_t = sum_j g_j expert_{e_j}(x_t), e_1..e_k the token's k likeliest experts (ties to the lower index), g_j their
    probabilities renormalised to sum to 1 from k = 2, the probability itself at k = 1 (Switch Transformer's). `moe`
    lends its weights (every expert's); x (B, T, C) -> (B, T, C)."""
    E, k = moe.n_experts, moe.top_k
    out = []
    for x_t in x.reshape(-1, x.size(-1)):
        logits = moe.router.weight @ x_t  # (E,)
        p = torch.exp(logits - logits.max())
        p = p / p.sum()
        ranked = sorted(range(E), key=lambda e: (-p[e].item(), e))
        # two implementations may round a near-tie differently: none here, so the choice is the same
        assert k == E or logits[ranked[k - 1]] - logits[ranked[k]] > 1e-4, "a near-tie"
        g = p[ranked[:k]]
        g = g / g.sum() if k > 1 else g
        y_t = torch.zeros_like(x_t)
        for g_j, e in zip(g, ranked[:k]):
            expert = moe.experts[str(e)]
            hidden = F.gelu(expert.c_fc.weight @ x_t + expert.c_fc.bias)
            y_t = y_t + g_j * (expert.c_proj.weight @ hidden + expert.c_proj.bias)
        out.append(y_t)
    return torch.stack(out).view_as(x)


MOE_TOL = 1e-5  # fp32 sums of a few dozen terms: about 1e-6 of a tensor's largest entry apart


def largest_relative(pairs):
    """The largest max |a - b| / max |b| over the tensors' pairs (each pair: the code's, the reference's); a NaN in
    any pair fails (torch's max keeps a NaN, conftest.worst then fails on it)."""
    return worst((((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in pairs), "MoE")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_moe_equals_the_per_token_reference_with_every_gradient(k):
    """MoE.forward (route, sort, experts, combine) against per_token_moe: the output, and the gradients of the input,
    the router and every expert under a language-model-like loss sum(w y) (no aux loss: the router learns through
    its gates alone, k = 1 included)."""
    moe = distinct_moe(k)
    reference = copy.deepcopy(moe)
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 2, 5, 16, generator=generator)
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    y, expected = moe(inputs[0]), per_token_moe(reference, inputs[1])
    (y * w).sum().backward()
    (expected * w).sum().backward()
    pairs = [(y, expected), (inputs[0].grad, inputs[1].grad)]
    pairs += [(p.grad, reference.get_parameter(n).grad) for n, p in moe.named_parameters()]
    assert len(pairs) == 2 + 1 + 4 * 4  # the router, and each expert's 2 weights and 2 biases
    print(f"k = {k}: worst {largest_relative(pairs):.2e}, router's gradient norm {moe.router.weight.grad.norm():.2e}")
    assert largest_relative(pairs) <= MOE_TOL
    assert moe.router.weight.grad.norm() > 1


def grouped_experts(moe, held, grouped):
    """moe's experts `held` (global indices) as ep_train.py holds them: a GroupedExperts of their weights stacked
    (grouped: torch._grouped_mm, else a matmul pair an expert); the same values."""
    config = SimpleNamespace(n_embd=moe.router.in_features, expert_hidden=moe.experts["0"].c_fc.out_features, bias=True)
    experts = GroupedExperts(held, config, grouped)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.copy_(torch.stack([moe.experts[str(i)].get_parameter(name) for i in held]))
    return experts


def expert_gradients(experts, reference):
    """(this gradient, the reference's) for every tensor of every expert of `experts` (a GroupedExperts): expert
    held[j]'s are row j of the stacked tensors' gradients, the reference's those of the one-process MoE `reference`'s
    experts.{held[j]}."""
    return [(p.grad[j], reference.experts[str(i)].get_parameter(name).grad) for name, p in experts.named_parameters()
            for j, i in enumerate(experts.held)]


def _per_token_ep(rank, world_size):
    """For k = 1, 2, 4, grouped (torch._grouped_mm) and not (a loop): a MoE layer whose dispatch is ExpertParallel
    (distinct experts, 2r and 2r+1 on rank r) against per_token_moe over both ranks' rows (2 and 3 sequences: uneven),
    under sum(w y): largest_relative() of the output, the input's gradient, the router's (summed over the ranks, as
    the buckets sum it) and this rank's experts'."""
    found = {}
    for k in (1, 2, 4):
        for grouped in (True, False):
            reference = distinct_moe(k)
            moe = copy.deepcopy(reference)
            moe.experts = grouped_experts(reference, [2 * rank, 2 * rank + 1], grouped)
            moe.dispatch_combine = ExpertParallel(moe.experts, SimpleNamespace(n_experts=4, top_k=k), dist.group.WORLD)
            x, w = torch.randn(2, 5, 4, 16, generator=torch.Generator().manual_seed(k))
            mine = slice(2 * rank, 2 + 3 * rank)
            inputs = [x[mine].clone().requires_grad_(), x.clone().requires_grad_()]
            y, expected = moe(inputs[0]), per_token_moe(reference, inputs[1])
            (y * w[mine]).sum().backward()
            (expected * w).sum().backward()
            router = moe.router.weight.grad.clone()
            dist.all_reduce(router)
            pairs = [(y, expected[mine]), (inputs[0].grad, inputs[1].grad[mine])]
            pairs += [(router, reference.router.weight.grad)] + expert_gradients(moe.experts, reference)
            found[k, grouped] = largest_relative(pairs), len(pairs)
    return found


def test_expert_parallel_equals_the_per_token_reference_with_every_gradient(runs):
    for rank, r in enumerate(runs["checks2"]):
        print(f"rank {rank}: worst per k {r['per_token']}")
        assert len(r["per_token"]) == 3 * 2, "k = 1, 2, 4, each grouped and as a loop"
        assert all(w <= MOE_TOL and n == 3 + 2 * 4 for w, n in r["per_token"].values()), (rank, r["per_token"])


def test_router_logits_are_fp32_under_bf16_autocast(monkeypatch):
    """The router's matmul runs in fp32 under autocast, as its softmax does: the probabilities are those of fp32."""
    moe = distinct_moe(2)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    found = []
    monkeypatch.setattr(common.model, "route", lambda probs, k: found.append(probs) or route(probs, k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert found[0].dtype == torch.float32
    assert torch.allclose(found[0], torch.softmax(x @ moe.router.weight.t(), dim=-1), rtol=1e-6, atol=1e-7)


def test_experts_default_to_the_dense_mlps_flops_and_dense_stays_dense():
    args = parse_args("ep", None, TINY + ["--n_experts", "8", "--top_k", "2"])
    assert gpt_config(args).expert_hidden == 4 * 64 // 2
    dense = gpt_config(parse_args("ddp", None, TINY))
    assert (dense.n_experts, dense.top_k, dense.expert_hidden) == (0, 0, 0)
    assert not any("expert" in n or "router" in n for n, _ in GPT(dense, device="meta").named_parameters())


# ---- bad input: one line each, from the scripts' own checks (no launch) -----------------------------------------

BAD = [
    ("ep_train.py", ["--n_experts", "4"], 3, "--n_experts: 4 must be divisible by the EP size (3"),
    ("ep_train.py", ["--n_experts", "4", "--data_parallel_size", "2"], 6, "--n_experts: 4 must be divisible by the EP"),
    ("ep_train.py", ["--n_experts", "4", "--top_k", "5"], 2, "--top_k: must be <= --n_experts (4), got 5"),
    ("ep_train.py", ["--top_k", "0"], 2, "--top_k: must be >= 1, got 0"),
    ("ep_train.py", ["--n_experts", "0"], 2, "--n_experts: ep_train.py shards the experts"),
    ("ep_train.py", ["--data_parallel_size", "3"], 4, "--data_parallel_size: 3 must be > 0 and divide"),
    ("ep_train.py", ["--n_experts", "4", "--top_k", "-1"], None, "--top_k: must be >= 1, got -1"),
    ("ep_train.py", ["--n_experts", "4", "--compile"], None, "--compile: not with --n_experts"),
    *[(script, ["--n_experts", "4"], None, "--n_experts: ") for script in
      ("ddp_train.py", "fsdp_train.py", "zero3_train.py", "tp_train.py", "pp_train.py", "cp_train.py",
       "hybrid_train.py", "pp_zb_train.py", "tp_overlap_train.py")],
    ("ddp_train.py", ["--top_k", "2"], None, "--top_k: "),
]


@pytest.mark.parametrize("script,flags,nproc,line", BAD, ids=[f"{s[:-9]}{' '.join(f)}-{n or 1}r" for s, f, n, _ in BAD])
def test_bad_input_is_one_line(script, flags, nproc, line, tmp_path, monkeypatch, capsys):
    error = refusal(script, nproc, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags, monkeypatch,
                    capsys)
    assert line in error, error
    if script != "ep_train.py":
        assert "trains the dense GPT; a mixture of experts trains in ep_train.py (in one process too)" in error
