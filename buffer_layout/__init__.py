"""Where each param's grad lives in a fused buffer: slots, shards and the views into them.

The layout half of Paddle's `python/paddle/distributed/fleet/utils/tensor_fusion_helper.py` at
commit 9b40c67f672f (PR #59739): `flatten_layout` gives ALL_REDUCE / REDUCE buckets one slot per
param, 256-byte aligned; `build_reduce_scatter_buffer` pads each param so that every rank's
shard of a REDUCE_SCATTER bucket starts on a 256-byte boundary, moves the params into one flat
param buffer and returns one `ShardingGradView` per param. Nothing here communicates;
`comm_buffer.FusedCommBuffer` builds on it (and re-exports these names).
"""
import torch

ALIGNMENT_BYTES = 256  # Paddle's alignment["gpu"]: each slot starts on a 256-byte boundary


def _grad_of(param, use_main_grad):
    return param.main_grad if use_main_grad else param.grad


def _set_grad(param, use_main_grad, value):
    if use_main_grad:
        param.main_grad = value
    else:
        param.grad = value


def _share_param_buffer(param, param_buffer, index):
    """Copy `param` into `param_buffer[index:index+numel]` and make it a view of that range."""
    flat = param_buffer[index : index + param.numel()]
    flat.copy_(param.detach().reshape(-1))
    param.data = flat.view(param.shape)  # same Parameter object: optimizers keep working


class ShardingGradView:
    """One parameter's place in a REDUCE_SCATTER bucket (Paddle's `ShardingGradView`).

    The param occupies elements `[index, index + padded_size)` of the flat param buffer and of the
    grad buffer (1-D, `padded_size` a multiple of `(256 / elem_size) * sharding_degree`). This rank
    owns `[rank * shard, (rank + 1) * shard)`, `shard = buffer numel / sharding_degree`, and
    `_param_begin:_param_end` is the overlap of the two ranges in buffer elements: it may be empty,
    may include padding, and a param may straddle ranks. `_slice_grad` is the 1-D grad view of
    that overlap; the optimizer's slice param is the matching 1-D view of the param buffer.
    """

    def __init__(self, param, param_buffer, grad_buffer, index, padded_size, sharding_degree,
                 rank, use_main_grad=False, release_grad=False):
        self._param = param
        self._param_buffer = param_buffer
        self._grad_buffer = grad_buffer
        self._index = index
        self._padded_size = padded_size
        self._use_main_grad = use_main_grad
        shard = param_buffer.numel() // sharding_degree
        self._rank_begin = rank * shard  # this rank's shard starts here (buffer elements)
        self._param_begin = max(index, rank * shard)
        self._param_end = min(index + padded_size, (rank + 1) * shard)
        # Differs from Paddle: an overlap made of padding only counts as empty here, so a rank
        # whose shard holds none of this param's elements gets no slice and no optimizer state
        # (Paddle hands its optimizer that all-zero slice; it stays zero under SGD and Adam).
        self._has_local = self._param_begin < min(self._param_end, index + param.numel())
        self._slice_grad = None
        if not release_grad:
            self._link_grad_to_buffer()
        _share_param_buffer(param, param_buffer, index)

    def _slice_grad_from_buffer(self):
        """Set `_slice_grad` from `_grad_buffer`; return the param's 1-D grad view (numel)."""
        if self._has_local:
            self._slice_grad = self._grad_buffer[self._param_begin : self._param_end]
        return self._grad_buffer[self._index : self._index + self._param.numel()]

    def _link_grad_to_buffer(self):
        grad = self._slice_grad_from_buffer().view(self._param.shape)
        _set_grad(self._param, self._use_main_grad, grad)

    def fill_slice_param(self, slice_param):
        """Make `slice_param` the 1-D view `param_buffer[_param_begin:_param_end]`."""
        slice_param.data = self._param_buffer[self._param_begin : self._param_end]

    def assign_slice_grad(self, slice_param):
        """Fill `slice_param` and bind its grad (or main_grad) to `_slice_grad`; skip if empty."""
        if self._slice_grad is None:
            return
        self.fill_slice_param(slice_param)
        if self._use_main_grad:
            current = getattr(slice_param, "main_grad", None)
        else:
            current = slice_param.grad
        if current is None:
            _set_grad(slice_param, self._use_main_grad, self._slice_grad)
        else:  # as Paddle asserts: a bound slice grad is already this step's `_slice_grad`
            assert current.data_ptr() == self._slice_grad.data_ptr(), "stale slice grad"

    def _reset_grad_buffer(self, slice_grad_buffer=None):
        """Drop this view's grad buffer references (Paddle frees them with _clear_dataptr).

        With `slice_grad_buffer` (free_grads_in_comm: the 1-D shard of `numel / degree`
        elements that the reduce-scatter wrote), re-point `_slice_grad` into it, as Paddle's
        `_reset_grad_buffer(slice_grad_buffer)` does.
        """
        self._slice_grad = None
        self._grad_buffer = slice_grad_buffer
        if slice_grad_buffer is not None and self._has_local:
            self._slice_grad = slice_grad_buffer[self._param_begin - self._rank_begin :
                                                 self._param_end - self._rank_begin]


def build_reduce_scatter_buffer(params, sharding_degree, rank, use_main_grad=False,
                                release_grad=False):
    """Lay out a REDUCE_SCATTER bucket; move `params` into one flat param buffer.

    Each param is padded to a multiple of `unit = (256 / elem_size) * sharding_degree` elements,
    so every rank's shard starts on a 256-byte boundary. Worked example, bf16 params of 300, 1000
    and 20 elements on 4 ranks: unit 512; padded 512, 1024, 512; total 2048, shard 512; the first
    lies on rank 0, the second straddles ranks 1 and 2 (rank 2's piece ends in 24 padding elements),
    the third is 20 elements plus padding on rank 3; rank 0's overlap with the second is empty.
    Returns `(views: dict[param, ShardingGradView], total elements, param_buffer, grad_buffer)`;
    the grad buffer (fp32 with main_grad, else param dtype, zero-filled) is None when releasing.
    """
    dtype, device = params[0].dtype, params[0].device
    unit = ALIGNMENT_BYTES // dtype.itemsize * sharding_degree
    padded = [(p.numel() + unit - 1) // unit * unit for p in params]
    total = sum(padded)
    grad_dtype = torch.float32 if use_main_grad else dtype
    param_buffer = torch.zeros(total, dtype=dtype, device=device)
    grad_buffer = None if release_grad else torch.zeros(total, dtype=grad_dtype, device=device)
    views, index = {}, 0
    for p, size in zip(params, padded):
        views[p] = ShardingGradView(p, param_buffer, grad_buffer, index, size, sharding_degree,
                                    rank, use_main_grad, release_grad)
        index += size
    return views, total, param_buffer, grad_buffer


def flatten_layout(params):
    """Offsets of an ALL_REDUCE / REDUCE bucket (layout half of Paddle's flatten_dense_tensors).

    Each param's slot is its numel padded up to 256 bytes measured in the *param* dtype, also
    when the buffer holds fp32 main grads (bf16, 1000 elements: 2000 B + 48 B of padding, a slot
    of 1024 elements, i.e. 4096 B of fp32). Returns `(buffer_size in elements,
    param2offset: dict[param, element offset])`.
    """
    size, param2offset = 0, {}
    for p in params:
        pad_bytes = -p.numel() * p.element_size() % ALIGNMENT_BYTES
        param2offset[p] = size
        size += p.numel() + pad_bytes // p.element_size()
    return size, param2offset
