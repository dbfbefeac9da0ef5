"""torch's `Optimizer.add_param_group` on the wrappers (Paddle's optimizers have no such call).

Sharding v1 gives the new params owners (largest first, to the least loaded rank, after the
params it holds), alike on every rank; `MixPrecisionOptimizer` gives them fp32 masters. v2, and
v1 under a comm overlap, lay their fused buffers out when they are built and refuse it. The
wrappers import this module at the call.
"""
from relgrad import new_params


def add_param_group(opt, param_group):
    """`opt.add_param_group(param_group)` of a wrapper (v1, v2, MixPrecisionOptimizer)."""
    if not hasattr(opt, "_is_v2"):  # MixPrecisionOptimizer: masters for the new params
        opt._inner_opt.add_param_group(opt._master_group(param_group, param_group["params"]))
        return
    if opt._is_v2:
        raise ValueError(f"{type(opt).__name__} cannot add a param group after it was built; "
                         "build the torch optimizer with every group first, then wrap it")
    if opt.pp_overlap or opt.comm_overlap:
        which = "pp_configs.sharding_" if opt.pp_overlap else "sharding_configs."
        raise ValueError(f"add_param_group is not supported with {which}comm_overlap (the "
                         "buffers are built with the optimizer): build it with every group")
    params = new_params(param_group["params"], opt._parameter_list)
    opt._param2rank.update(opt._partition_parameters(params))
    opt._parameter_list += params
    owned = [p for p in params if opt._param2rank[p] == opt._rank]
    opt._inner_opt.add_param_group({**param_group, "params": owned})
    opt._finish_clear()
