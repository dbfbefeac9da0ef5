"""Tests of the recovery rule: a step that fails, fails on every rank of the job, leaves every
rank in the same state, and after the documented clear (`opt.zero_grad()`, or
`zero_grad(set_to_none=False)` with release off) training goes on exactly as one process that
skipped the refused step. Rank-side code: relgrad_checks/recovery.py."""
import pytest
import torch

from relgrad_checks import recovery
from test_all import _assert_params, _same_error, ranks  # noqa: F401 (the fixture)


def _same_text(seen, world, *words):
    """Every rank raised the same ValueError, one text, containing each of `words`."""
    _same_error(seen, world, words[0])
    assert seen[0][0] == "ValueError" and len({text for _, text in seen}) == 1, seen
    for word in words[1:]:
        assert word in seen[0][1], (word, seen[0][1])


def _check_recovered(results, world, *words):
    """Per case: the same ValueError with `words` on every rank; no param changed by the bad
    step; buffers freed (release on); the params at the end within 1e-6 of the oracle; and
    release off and on bitwise equal."""
    assert len(results) == world and len(results[0]) > 0
    assert all(r.keys() == results[0].keys() for r in results)
    for case in results[0]:
        rows = [r[case] for r in results]
        _same_text([row[0] for row in rows], world, *words)
        for _, unchanged, freed, params, oracle, *_ in rows:
            assert unchanged and freed, (case, unchanged, freed)
            _assert_params(params, oracle, atol=1e-6)
    for r in results:
        pairs = [(r[c][3], r[c.replace("release=False", "release=True")][3]) for c in r
                 if "release=False" in c]
        for off, on in pairs:
            assert len(off) == len(on) > 0 and all(map(torch.equal, off, on))


@pytest.mark.parametrize("family", ["dp", "sharding"])
def test_lr_on_one_stage_refused_on_every_rank(ranks, family):
    """Check that an lr set 1.25x by hand on one rank of stage 1 (pp 2 x dp 2 with dp overlap off / on;
    pp 2 x sharding 2, v1 / v2, sharding overlap off / on; release off / on) makes train_batch
    raise the same ValueError on all 4 ranks naming the lr, steps nothing, frees the buffers,
    and that with the lr set back and the grads cleared training matches one process that
    skipped that batch (1e-6; the lr changes params by ~1e-3)."""
    results = ranks(4).run(recovery.lr_on_one_stage, family, timeout=60)
    _check_recovered(results, 4, "step was refused", "param_groups[0]['lr'] differs across ranks")


def test_unfrozen_bias_on_one_stage_refused_on_every_rank(ranks):
    """Check that a bias frozen when v2 and the pipeline were built and unfrozen on its stage
    (pp 2 x sharding 2, sharding overlap off / on, release off / on) makes train_batch raise
    the same ValueError on all 4 ranks, and that refrozen and cleared, training matches one
    process with the bias frozen that skipped that batch."""
    results = ranks(4).run(recovery.unfrozen_on_one_stage, timeout=60)
    _check_recovered(results, 4, "frozen")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", ["branch", "lr"])
def test_free_in_comm_refused_step_recovers(ranks, version, case):
    """Check that under sharding's own overlap with free_grads_in_comm (2 ranks, 4 buckets) a
    step that rank 1's backward leaves a branch out of, or whose lr differs on rank 1, raises
    the same ValueError at step() on both ranks within 4 s (no wait inside backward), and
    that after zero_grad() the next steps match one process that skipped it."""
    result = ranks(2).run(recovery.free_in_comm_own, version, case, timeout=60)
    _check_recovered([{case: r} for r in result], 2,
                     "bucket" if case == "branch" else "param_groups[0]['lr'] differs")
    assert all(len(r[5]) > 1 and r[6] < 4 for r in result), [r[5:] for r in result]


def test_free_in_comm_pipeline_refused_batch_recovers(ranks):
    """Check that pp 2 x sharding 2 with sharding overlap and free_grads_in_comm (v1, v2) ends
    a batch in which one rank's bias gets no grad with the same ValueError on all 4 ranks,
    and that the next batches match one process that skipped it."""
    results = ranks(4).run(recovery.free_in_comm_pipeline, timeout=60)
    _check_recovered(results, 4, "bucket")


def test_store_keys_constant_own_overlap(ranks):
    """Check that 40 steps of sharding's own overlap (v1 / v2, release off / on; a store
    round per step) leave the default store's key count as it was after step 1, as plain
    torch does."""
    results = ranks(2).run(recovery.store_keys_own_overlap, timeout=60)
    _check_constant_keys(results, 2, 5)


def test_store_keys_constant_train_batch(ranks):
    """Check that 40 train_batch calls on pp 2 x sharding 2 (v1 / v2, sharding overlap,
    release off / on; an entry check marking arrivals) leave the store's key count as it was
    after the first."""
    _check_constant_keys(ranks(4).run(recovery.store_keys_train_batch, timeout=60), 4, 4)


def _check_constant_keys(results, world, cases):
    assert len(results) == world and all(len(r) == cases for r in results), results
    grown = {case: counts[-1] - counts[0] for r in results for case, counts in r.items()
             if len(counts) != 40 or counts[-1] != counts[0]}
    assert not grown, f"keys added from step 1 to step 40: {grown}"


def test_interleave_param_in_two_chunks_refused_at_build(ranks):
    """Check that one nn.Linear at layers 0 and 4 of PipelineParallelWithInterleave (pp 2,
    2 virtual stages: chunks 0 and 2 of stage 0; v2 sharding overlap and dp overlap, release
    off / on) raises the same ValueError at construction on all 4 ranks, naming both chunks
    (or layers) and shared_weights."""
    results = ranks(4).run(recovery.param_in_two_chunks, timeout=60)
    assert len(results) == 4 and len(results[0]) == 4
    for case in results[0]:
        seen = [r[case][0] for r in results]
        assert all(s is not None for s in seen), (case, [r[case] for r in results])
        _same_text(seen, 4, "shared_weights")
        text = seen[0][1]
        assert ("chunk 0" in text and "chunk 2" in text) or ("'0.weight'" in text
                                                              and "'4.weight'" in text), text


def test_incomplete_bucket_names_the_param_own_overlap(ranks):
    """Check that a branch rank 1's backward leaves out under sharding's own overlap (acc 2,
    v1 / v2, release off / on) raises on both ranks the same ValueError naming the param by
    index, shape (3, 4) and bucket, and that clearing and training on matches one process."""
    results = ranks(2).run(recovery.unused_branch_named, timeout=60)
    _check_recovered(results, 2, "param #", "bucket", "(3, 4)")


def test_incomplete_bucket_names_the_param_reentrant_checkpoint(ranks):
    """Check that stage 0's first Linear under a reentrant checkpoint on data (pp 2 x sharding
    2, sharding overlap, acc 2, v1 / v2, release off / on; its params get no grad) raises on
    all 4 ranks the same ValueError naming the param (#, shape (8, 6), bucket) and
    use_reentrant=False, and that with use_reentrant=False training matches one process."""
    results = ranks(4).run(recovery.reentrant_checkpoint, timeout=60)
    _check_recovered(results, 4, "param #", "bucket", "(8, 6)", "use_reentrant=False")


def test_frozen_after_build_refused_own_overlap(ranks):
    """Check that a layer frozen after build under sharding's own overlap (v1 / v2, release
    off / on) makes step() raise the same ValueError on both ranks, and that unfrozen and
    cleared, training matches one process that skipped that step."""
    results = ranks(2).run(recovery.frozen_after_build, timeout=60)
    _check_recovered(results, 2, "bucket")


def _bitwise(got, want):
    assert len(got) == len(want) > 0 and all(map(torch.equal, got, want)), max(
        (g - w).abs().max().item() for g, w in zip(got, want))


@pytest.mark.parametrize("world", [2, 4])
def test_lone_weight_bucket_matches_one_process(ranks, world):
    """Check that a 1.03 MiB weight alone in its 1 MB bucket (sharding's own overlap on 2
    ranks, or on stage 0 of pp 2 x sharding 2 with sharding overlap; acc 2, v1 / v2, release
    off / on, AdamW 3 steps) ends bitwise equal to one process summing the grads as the ranks
    do (AdamW hides a constant grad scale up to eps: no tolerance)."""
    results = ranks(world).run(recovery.lone_weight, timeout=60)
    assert len(results) == world and all(len(r) == 4 for r in results)
    for rank, r in enumerate(results):
        for params, want, sizes in r.values():
            assert 1 in sizes or rank >= 2, sizes  # the weight's bucket holds it alone
            _bitwise(params, want)
