"""Tests of more habits DDP users bring, each against an independent reference: torch's
DistributedDataParallel on the same ranks and data (bitwise: with 2 ranks the fp32 mean is the
same either way), or one plain-torch process; release off and on in every scenario.
Rank-side code and snippet texts: relgrad_checks/ddp_habits.py."""
import torch

from relgrad_checks import ddp_habits, recipes
from relgrad_checks.common import _assert_bitwise
from test_all import _assert_params, _recipe, _same_error, ranks  # noqa: F401 (the fixture)


def _same_text(seen, world, *words):
    """Every rank raised the same ValueError, one text, containing each of `words`."""
    _same_error(seen, world, words[0])
    assert seen[0][0] == "ValueError" and len({text for _, text in seen}) == 1, seen
    for word in words[1:]:
        assert word in seen[0][1], (word, seen[0][1])


def _by_case(results, world, count):
    """{case: [each rank's value]} of `world` ranks' {case: value}, `count` cases each."""
    assert len(results) == world and all(len(r) == count for r in results), results
    assert all(r.keys() == results[0].keys() for r in results)
    return {case: [r[case] for r in results] for case in results[0]}


def _run(folder, files, source):
    """Run `source` from the empty `folder` on 2 ranks; (codes, outputs, saved states, evals)."""
    folder.mkdir()
    codes, outputs, _ = recipes.run_recipe(folder, files, source, world=2, save=False)
    load = [[torch.load(p) if (p := folder / f"{k}_rank{r}.pt").exists() else None
             for r in range(2)] for k in ("state", "eval")]
    return codes, outputs, *load


def test_batchnorm_recipe_a_bitwise_like_ddp(tmp_path):
    """Check that README recipe (a) as written, with a BatchNorm1d model and rank-specific data
    on 2 ranks, release off / on, ends with params and BatchNorm buffers bitwise those of
    torch's DDP (no_sync but on the last micro-batch), and its eval pass after
    broadcast_buffers(model, None) gives DDP's eval outputs bitwise."""
    files, source = _recipe("a")
    codes, outputs, want, want_eval = _run(tmp_path / "ddp", [], ddp_habits.DDP_BN)
    assert codes == [0, 0], outputs
    assert len(want[0]["buffers"]) == 3 and len(want[0]["params"]) == 6
    assert not torch.equal(want[0]["buffers"][0], want[1]["buffers"][0])  # rank-local stats
    for release in (False, True):
        codes, outputs, got, got_eval = _run(tmp_path / f"release_{release}", files,
                                             ddp_habits.bn_recipe(source, release))
        assert None not in got, outputs
        for rank in range(2):
            for kind in ("params", "buffers"):
                _assert_bitwise(got[rank][kind], want[rank][kind], (kind, release, rank))
        assert codes == [0, 0], outputs
        _assert_bitwise(got_eval, want_eval, ("eval", release))


def test_zero_grad_to_none_release_off_recipe_a(tmp_path):
    """Check that README recipe (a) with RELEASE = False and torch's opt.zero_grad() (to None)
    on 2 ranks trains bitwise like the recipe as written (release on) and within 1e-6 of one
    process, and that after each step's backward every grad is its slot's view again."""
    files, source = _recipe("a")
    (tmp_path / "off").mkdir(), (tmp_path / "on").mkdir()
    off = recipes.run_recipe(tmp_path / "off", files, ddp_habits.zero_grad_default_recipe(
        source), world=2)
    on = recipes.run_recipe(tmp_path / "on", files, source, world=2)
    assert off[0] == on[0] == [0, 0], (off[1], on[1])
    want = recipes.reference(recipes._mlp(), range(6), rows=16, clip=1.0)
    for rank in range(2):
        _assert_bitwise(off[2][rank], on[2][rank], rank)
        _assert_params(off[2][rank], want)
        views = torch.load(tmp_path / "off" / f"views_rank{rank}.pt")
        assert len(views) == 6 and all(v == [True] * 4 for v in views), views


def test_zero_grad_to_none_release_off_sharding(ranks):
    """Check that torch's zero_grad() default after each step with release off trains v1 (own
    overlap off / on) bitwise like release on and within 1e-6 of one process, each grad its
    slot's view again after backward, and that v2 with release off raises the same ValueError
    on both ranks naming set_to_none=False, then trains on with zero_grad(set_to_none=False)."""
    results = ranks(2).run(ddp_habits.zero_grad_default, timeout=60)
    oracle = results[0][1]
    cases = _by_case([r[0] for r in results], 2, 6)
    for case, rows in cases.items():
        for seen, views, params in rows:
            _assert_params(params, oracle)
            if case.startswith("v=1"):
                assert seen is None, (case, seen)
                assert views == [None if "overlap=False" in case or "release=True" in case
                                 else True] * ddp_habits.STEPS, (case, views)
        if case.startswith("v=2"):
            _same_text([row[0] for row in rows], 2, "should not erase grad buffer",
                       "set_to_none=False")
    for overlap in (False, True):
        off, on = (cases[f"v=1 overlap={overlap} release={r}"] for r in (False, True))
        for rank in range(2):
            _assert_bitwise(off[rank][2], on[rank][2], (overlap, rank))


def test_torch_clip_on_model_refused_without_overlap(ranks):
    """Check that torch.nn.utils.clip_grad_norm_ on the model between backward and step() (v1 /
    v2 without overlap, release off / on) makes step() raise the same ValueError on both ranks
    naming opt.clip_grad_norm_, steps nothing, and that cleared and trained on with
    opt.clip_grad_norm_(1.0) the params are within 1e-6 of one process using torch's clip."""
    results = ranks(2).run(ddp_habits.torch_clip_no_overlap, timeout=60)
    oracle = results[0][1]
    for case, rows in _by_case([r[0] for r in results], 2, 4).items():
        _same_text([row[0] for row in rows], 2, "changed in place", "opt.clip_grad_norm_")
        for _, unchanged, params in rows:
            assert unchanged, case
            _assert_params(params, oracle)


def test_grad_scaler_refused_then_trains(ranks):
    """Check that torch.amp.GradScaler driving v1 / v2 (own overlap off / on, release off / on),
    in train.py's unscale_ + clip order or scaler.step right after backward, with an inf in one
    grad on rank 1, raises the same ValueError on both ranks naming GradScaler and bf16 before
    anything is stepped (no NaN), and that cleared, training on without the scaler matches one
    process over the later steps (1e-6)."""
    results = ranks(2).run(ddp_habits.grad_scaler, timeout=90)
    oracle = results[0][1]
    for case, rows in _by_case([r[0] for r in results], 2, 16).items():
        _same_text([row[0] for row in rows], 2, "GradScaler", "bf16")
        for _, unchanged, later, params in rows:
            assert unchanged, case
            assert later is None, (case, later)
            _assert_params(params, oracle)


def test_train_py_order_frees_with_extra_zero_grad(ranks):
    """Check that in train.py's order (zero_grad after the forward) with release on, v1 / v2,
    own overlap off / on, an extra zero_grad() after step() makes every later forward and the
    eval forward between steps start with every fused buffer freed and no grad, that without it
    they hold them, and that both train within 1e-6 of one process."""
    results = ranks(2).run(ddp_habits.train_py_order, timeout=60)
    oracle = results[0][1]
    for case, rows in _by_case([r[0] for r in results], 2, 8).items():
        for seen, n_buffers, params in rows:
            assert (n_buffers == 0) == case.startswith("v=1 overlap=False"), case
            assert [t for t, _ in seen] == [True, False] * ddp_habits.STEPS, (case, seen)
            holds = (n_buffers > 0, True)
            want = ([(False, False)] * 2 * ddp_habits.STEPS if "extra=True" in case else
                    [(False, False)] + [holds] * (2 * ddp_habits.STEPS - 1))
            assert [h for _, h in seen] == want, (case, seen)
            _assert_params(params, oracle)


def test_step_pre_hook_and_finish_grad_sync_see_reduced_grads(ranks):
    """Check that under sharding's own overlap (v1 / v2, release off / on, acc 1 / 2) the grads
    of what each rank steps, read in a step pre-hook or right after opt.finish_grad_sync(), are
    within 1e-6 of one process's mean grads, that step() after finish_grad_sync() leaves them
    bitwise as they were, and that the params end within 1e-6 of one process."""
    results = ranks(2).run(ddp_habits.grads_final, timeout=90)
    grads, oracle = results[0][1]
    assert len(grads) == ddp_habits.STEPS
    for case, rows in _by_case([r[0] for r in results], 2, 16).items():
        for seen, kept, params in rows:
            assert len(seen) == ddp_habits.STEPS, (case, len(seen))
            for step, entries in enumerate(seen):
                assert len(entries) > 0, case
                for index, start, grad in entries:
                    want = grads[step][index]
                    want = want if start is None else want.reshape(-1)[start: start + len(grad)]
                    torch.testing.assert_close(grad, want, rtol=0, atol=1e-6)
            assert kept == ([True] * ddp_habits.STEPS if "how=finish" in case else []), case
            _assert_params(params, oracle)


def test_wrong_comm_group_under_pp_dp_refused_at_build(ranks):
    """Check that a bare FusedCommBuffer built with comm_group=None on 4 ranks whose two stages
    hold params of other shapes (same count and elements) or another dtype raises the same
    ValueError at build on every rank naming comm_group, and that built with each stage's dp
    group one SGD step matches one process averaging the two replicas' grads."""
    for case, rows in _by_case(ranks(4).run(ddp_habits.wrong_group, timeout=60), 4, 4).items():
        _same_text([row[0] for row in rows], 4, "comm_group")
        for _, params, want in rows:
            _assert_params(params, want)


def test_acc_steps_message_names_micro_batches(ranks):
    """Check that a FusedCommBuffer built with acc_steps=1 under 4 micro-batches per step
    (release off / on) raises the same ValueError on both ranks saying acc_steps is the number
    of micro-batches."""
    for release, seen in _by_case(ranks(2).run(ddp_habits.acc_steps_message), 2, 2).items():
        _same_text(seen, 2, "micro-batches", "acc_steps=1")


def test_moe_expert_without_tokens_not_stepped(ranks):
    """Check that under the pipeline (pp 2, and pp 2 x dp 2, plain AdamW) an expert that gets no
    token in every other step ends bitwise equal with release off and on, and within 1e-6 of one
    process whose zero_grad() sets the grads to None."""
    for world in (2, 4):
        results = ranks(world).run(ddp_habits.moe_expert, timeout=60)
        for rank, (params, want) in enumerate(results):
            assert sorted(params) == [False, True]
            _assert_bitwise(params[False], params[True], (world, rank))
            _assert_params(params[True], want)


def test_pipeline_leaves_module_modes(ranks):
    """Check that train_batch and eval_batch (pp 2, plain SGD, release off / on) leave a
    BatchNorm1d set to eval() in eval mode with its running stats unchanged and the model's
    training flag as the user set it, and that the params are within 1e-6 of one process."""
    for rank, (out, want) in enumerate(ranks(2).run(ddp_habits.frozen_batchnorm, timeout=60)):
        assert sorted(out) == [False, True]
        for release, (modes, changed, params) in out.items():
            assert modes == [(True, False), (True, False), (False, False)], (rank, modes)
            assert not changed, (rank, release)
            _assert_params(params, want)
