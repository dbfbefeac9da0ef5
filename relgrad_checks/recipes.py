"""The recipes of the README and docs/, run as a user would: each snippet from an empty folder
holding only the files its recipe names, on local gloo ranks, against plain one-process torch.

`run_recipe` copies a recipe's files (`drift.readme_recipes()`) into a folder, appends a line
that saves each rank's params, and starts the ranks as torchrun would (RANK, WORLD_SIZE, a port
the OS picked). Each rank runs as `python -E -s recipe.py` in that folder: nothing of this repo is
imported before the snippet. On Linux the ranks fork from one launcher process per session
(this file run as a script, `_serve`) that imported torch and what torch.compile needs once
(~2 s of CPU per rank otherwise). The references train the same model on the whole batch in
one process, written from the recipes' descriptions, not from their code.
"""
import atexit
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
_SAVE = ("\n# added by the test: each rank's params after the snippet\nimport os\n"
         "torch.save([p.detach().clone() for p in model.parameters()], "
         "f\"params_rank{os.environ['RANK']}.pt\")\n")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(folder, files: list, source: str, world: int, timeout: float = 90,
               save: bool = True) -> tuple:
    """Copy `files` into `folder`, write `source` (plus the save line) as recipe.py, run it
    on `world` ranks, killed after `timeout` s. -> (returncodes, None if killed; outputs;
    params by rank or None). RuntimeError with its output if the launcher failed."""
    folder = Path(folder)
    for name in files:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, folder / name)
    (folder / "recipe.py").write_text(source + (_SAVE if save else ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RELGRAD"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="0")
    if sys.platform.startswith("linux"):
        done = _launcher().run({"folder": str(folder), "world": world, "timeout": timeout,
                                "env": env})
        codes, outputs = done["codes"], done["outputs"]
    else:  # no fork (Windows), or not a safe one (macOS): one fresh process per rank
        codes, outputs = _run_spawned(folder, world, timeout, env)
    params = None
    if save and all(code == 0 for code in codes):
        params = [torch.load(folder / f"params_rank{r}.pt") for r in range(world)]
    return codes, outputs, params


def _run_spawned(folder, world, timeout, env):
    """(returncodes, outputs) of `python -E -s recipe.py` in `folder` on `world` ranks."""
    procs = [subprocess.Popen([sys.executable, "-E", "-s", "recipe.py"], cwd=folder,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [proc.returncode for proc in procs], outputs


class _Launcher:
    """This file run as a script (`_serve`): one JSON request a line in, one reply out."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RELGRAD"))}
        env.update(OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="0")  # read at torch's import
        self._cwd = tempfile.mkdtemp(prefix="relgrad_recipes_")  # sys.path[0] of no recipe
        self._err = open(os.path.join(self._cwd, "launcher.err"), "w+")
        self._proc = subprocess.Popen([sys.executable, "-E", "-s", __file__, "--serve"],
                                      cwd=self._cwd, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._err, text=True)
        self._lock = threading.Lock()

    def run(self, request):
        with self._lock:
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except OSError:
                line = ""
            if not line:
                self._proc.kill()
                self._err.seek(0)
                raise RuntimeError("the recipe launcher process ended (status "
                                   f"{self._proc.wait()}); its output:\n{self._err.read()}")
            return json.loads(line)

    def close(self):
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._err.close()
        shutil.rmtree(self._cwd, ignore_errors=True)


_LAUNCHER = []


def _launcher():
    """The session's launcher process, started at the first recipe (again if it ended)."""
    if not _LAUNCHER or _LAUNCHER[0]._proc.poll() is not None:
        if _LAUNCHER:
            _LAUNCHER.pop().close()
        _LAUNCHER.append(_Launcher())
        atexit.register(_LAUNCHER[0].close)
    return _LAUNCHER[0]


def _serve():
    """The launcher's loop: each request's ranks forked and run (`_run_request`), one reply."""
    import torch._dynamo  # noqa: F401 (torch.optim imports it at the first optimizer built)
    # what recipe (f)'s torch.compile(backend="aot_eager") imports at its first call (~1.4 s
    # of CPU in each rank otherwise; its compile itself then takes ~0.5 s)
    import functorch.compile  # noqa: F401
    import torch._dynamo.backends.common  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    out_dir = tempfile.mkdtemp(prefix="relgrad_recipe_out_")
    for line in sys.stdin:
        sys.stdout.write(json.dumps(_run_request(json.loads(line), out_dir)) + "\n")
        sys.stdout.flush()


def _run_request(request, out_dir):
    """Fork a process per rank, each running recipe.py as `python -E -s` would there.
    -> {"codes": exit statuses (None: killed at the timeout), "outputs"}"""
    world, files, pids = request["world"], [], []
    for rank in range(world):
        files.append(os.path.join(out_dir, f"rank{rank}.out"))
        pid = os.fork()
        if pid == 0:
            _rank(request, rank, files[-1])  # never returns
        pids.append(pid)
    deadline, codes = time.monotonic() + request["timeout"], [None] * world
    while any(c is None for c in codes) and time.monotonic() < deadline:
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for i, pid in enumerate(pids):
        if codes[i] is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    outputs = []
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            outputs.append(f.read())
        os.remove(name)
    return {"codes": codes, "outputs": outputs}


def _rank(request, rank, out_file):
    """In a forked child: become rank `rank` of the recipe, run it, exit with its status."""
    code = 1
    try:
        fd = os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank))
        os.chdir(request["folder"])
        sys.argv = ["recipe.py"]
        sys.path[0] = request["folder"]  # as `python recipe.py` run in the folder has it
        code = _run_snippet()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run_snippet():
    """Run ./recipe.py as `__main__`; its exit status, an uncaught error printed as python does."""
    try:
        runpy.run_path("recipe.py", run_name="__main__")
        return 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 (what python prints for an uncaught error)
        tb = e.__traceback__  # from the snippet's frame on, as `python recipe.py` shows
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        return 1


# ---------------------------------------------------------------- one-process references

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def pipeline_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4))


def _batch(step, rows):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def reference(model: torch.nn.Module, steps, rows: int = 16, sched: bool = False,
              clip: float | None = None, paddle_clip: float | None = None, opt=None,
              norms: list | None = None) -> list:
    """Plain torch on the whole batch: `opt` or AdamW(1e-2), StepLR(2, 0.5) if `sched`,
    torch's clip or Paddle's (norms to `norms`). -> the params after the last step"""
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    for step in steps:
        x, y = _batch(step, rows)
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if paddle_clip is not None:  # Paddle's: clip / (max(norm, clip) + 1e-6), also below
            norm = torch.stack([p.grad.square().sum() for p in model.parameters()]).sum().sqrt()
            norms.append(norm.item())
            coef = paddle_clip / (torch.maximum(norm, torch.tensor(paddle_clip)) + 1e-6)
            for p in model.parameters():
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        if scheduler:
            scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def _add(sums, grads):
    """`grads` added to `sums` item by item (`grads` itself for the first)."""
    return grads if sums is None else [a + b for a, b in zip(sums, grads)]


def main_grad_reference(model: torch.nn.Module, steps, rows: int, world: int,
                        acc: int) -> list:
    """Recipe (e) in one process: bf16 params, fp32 masters under AdamW(1e-2), each
    replica's fp32 grads summed in order, scaled by 1/world. -> the bf16 params"""
    model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    for step in steps:
        x, y = _batch(step, rows)
        total = None
        for xr, yr in zip(x.chunk(world), y.chunk(world)):
            replica = None
            for xm, ym in zip(xr.chunk(acc), yr.chunk(acc)):
                (F.mse_loss(model(xm.to(torch.bfloat16)).float(), ym) / acc).backward()
                replica = _add(replica, [p.grad.float() for p in params])
                for p in params:
                    p.grad = None
            total = _add(total, replica)
        for master, grad in zip(masters, total):
            master.grad = grad * (1.0 / world)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
    return [p.detach().clone() for p in params]


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
