"""[later] Sharding's own comm overlap: `sharding_configs.comm_overlap`, without a pipeline.

Paddle's sharding optimizers hook their own fused buffers to backward
(`register_reduce_overlap_hook`), so that each bucket's reduce (v1: to its owner) or
reduce-scatter (v2) overlaps the last of `sharding_configs.accumulate_steps` backward passes;
`step()` then waits and scales. At the seed's commit v1 asserts it unsupported and v2's hooks
are uncertain; `DygraphShardingOptimizer(V2)` plug this in when the flag is set.

Beyond Paddle: the buckets fire in one order on every rank (`sharding.BucketScheduler`), and
`step()` and an early `zero_grad()` first agree through the store on the call (a rank that
skipped its backward has no collective in flight to pair with), so that a skipped backward
or one rank's early `zero_grad()` raises on every rank after every rank settled its
collectives. A backward that reaches the params between `step()` and `zero_grad()` (a GAN)
raises. Phases: hooks check in -> buckets fire in order -> step() agrees, waits, scales.
"""
from comm_buffer import HOOK_ACTION, FusedCommBuffer, agree, assign_group_by_size, global_rank
from relgrad import Phase
from sharding import BucketScheduler, plug_free_in_comm

_CALL_RULE = ("zero_grad() ran between backward and step() with comm_overlap's collectives in "
              "flight (or on some rank step()): every rank settled and cleared this step; go on")
_CALL_TITLE = ("under sharding_configs.comm_overlap every rank calls step() or zero_grad() alike: "
               "every rank settled and cleared this step; clear once more where a step() raised "
               "this, then go on")


class _Scheduler(BucketScheduler):
    """The bucket scheduler of one sharding optimizer `opt`: a backward that reaches its params
    between `opt.step()` and `opt.zero_grad()` raises (another model's loss, as a GAN's)."""

    def __init__(self, opt) -> None:
        super().__init__()
        self.opt = opt

    def check_in(self, buffer, param) -> None:
        if self.opt._phase == Phase.STEPPED:
            raise ValueError(f"bucket {buffer.id}: a backward reached its params after step() and "
                             "before zero_grad(): another model's loss reaches them (a GAN): "
                             "requires_grad_(False) on them for it, or detach() the fake batch")
        super().check_in(buffer, param)


class OwnOverlap:
    """The hooked buffers of one sharding optimizer `opt`, fired in one order (`scheduler`)."""

    def __init__(self, opt) -> None:
        self.opt, self.scheduler = opt, _Scheduler(opt)

    def hook(self, buffers: list) -> None:
        """Paddle's `register_reduce_overlap_hook(use_comm=True)` on `buffers`."""
        plug_free_in_comm(buffers, self.opt._free_grads_in_comm)
        for buffer in buffers:
            self.scheduler.add(buffer)

    def owner_buffers(self, acc_steps: int, group_size: int) -> list:
        """v1: REDUCE buffers per owner (Paddle's v1 fusion also fuses the params), hooked."""
        opt, buffers = self.opt, []
        for rank in range(opt._nranks):
            params = [p for p in opt._parameter_list
                      if p.requires_grad and opt._param2rank[p] == rank]
            for bucket in assign_group_by_size(params, group_size).values():
                buffers.append(FusedCommBuffer(
                    len(buffers), bucket, opt._group, acc_steps, HOOK_ACTION.REDUCE,
                    global_rank(opt._group, rank), release_grads=opt.sd_release_grads))
        self.hook(buffers)
        return buffers

    def before_agreement(self) -> None:
        """step(): agree on the call first, then issue every bucket the hooks did not."""
        self.agree_on_call("step()")
        self.scheduler.fire()

    def wait_and_agree(self) -> None:
        """The hooks issued the collectives: agree on the check-ins, wait, scale."""
        self.scheduler.wait_and_agree(self.opt._flag_groups(), self.opt._flags_device())

    def agree_on_call(self, call: str) -> None:
        """Agree through the store (no collective to pair) on the call and what is in flight;
        if any differs, every rank settles and raises."""
        most = self.scheduler.passes()[0]
        flying = None
        if call == "zero_grad()" and any(b.in_flight for b in self.scheduler.buffers):
            flying = f"{most} backward pass(es)"
        same = [("the call", call)]
        if call == "zero_grad()":
            same.append(("backward passes this step", most))
        try:
            agree(self.opt._flag_groups(), [(_CALL_RULE, flying)], same, via_store=True,
                  title=_CALL_TITLE)
        except ValueError:
            self.scheduler.settle()
            raise

    def settle_for_clear(self):
        """zero_grad(): `agree_on_call` unless the step ran; returns the error to raise (the
        phase then FAILED: every rank settled, so the next clear needs no store round)."""
        phase, error = self.opt._phase, None
        if phase == Phase.FAILED:  # refused alike on every rank: settle here, no store round
            self.scheduler.settle()
        elif phase != Phase.STEPPED:
            try:
                self.agree_on_call("zero_grad()")
            except ValueError as caught:
                error, self.opt._phase = caught, Phase.FAILED
        self.scheduler.reset()
        return error
