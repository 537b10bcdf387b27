"""A training run (tiny model, synthetic data, checkpoints every 2 steps) whose checkpoint saves start failing after
step 4 committed, ended as `train.py` ends (`clover_jax.cli.train.main`: `run_cli`, then `_end_process`).

    python save_fault_run.py RUN_DIR read-only|disk-full|none [--resume] [--steps=N]

read-only: the checkpoint folder is made immutable (`chattr +i`) at step 5; where the flag cannot be set, every
new file or folder under it is refused with EPERM instead. disk-full: the filesystem reports room (the check before
a save passes) but Orbax's writes under the folder fail with ENOSPC from step 5 on, the failure a disk that fills
during a save gives.
"""

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

from clover_jax import parallel  # noqa: E402
from clover_jax.cli import run_cli  # noqa: E402
from clover_jax.cli.train import _end_process  # noqa: E402
from clover_jax.training import checkpoint  # noqa: E402
from clover_jax.training.run import run_experiment  # noqa: E402
from training_helpers import SyntheticBatcher, make_cfg, tiny_base  # noqa: E402

run_dir, mode, resume = Path(sys.argv[1]), sys.argv[2], "--resume" in sys.argv
steps = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--steps=")), 8)
ckpt_dir = run_dir / "checkpoints"
failing = {"on": False}


def _refuse(path, code):
    if failing["on"] and str(path).startswith(str(ckpt_dir)):
        raise OSError(code, os.strerror(code), str(path))


def _inject(code):
    """Every new file or folder under the checkpoint folder, and every rename into it, fails with `code`."""
    real_open, real_mkdir, real_rename = os.open, os.mkdir, os.rename

    def fail_open(path, flags, *a, **k):
        if flags & os.O_CREAT:
            _refuse(path, code)
        return real_open(path, flags, *a, **k)

    def fail_mkdir(path, *a, **k):
        _refuse(path, code)
        return real_mkdir(path, *a, **k)

    def fail_rename(src, dst, *a, **k):
        _refuse(dst, code)
        return real_rename(src, dst, *a, **k)

    os.open, os.mkdir, os.rename = fail_open, fail_mkdir, fail_rename


if mode == "disk-full":
    real_usage = shutil.disk_usage
    checkpoint.shutil = type("shutil", (), {"disk_usage": staticmethod(
        lambda p: real_usage(p)._replace(free=1 << 40))})  # the check sees room; the writes then fail
    _inject(errno.ENOSPC)
def _can_set_immutable() -> bool:
    probe = run_dir.parent / ".immutable-probe"
    probe.mkdir(exist_ok=True)
    try:
        return subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode == 0
    except OSError:  # no chattr
        return False
    finally:
        subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
        probe.rmdir()


immutable = mode == "read-only" and _can_set_immutable()
if mode == "read-only" and not immutable:
    _inject(errno.EPERM)


def on_step(step, trainer):
    if step == 5 and mode != "none":
        while not (ckpt_dir / "4").is_dir():  # checkpoint 4 committed
            time.sleep(0.1)
        time.sleep(1.0)
        if immutable:
            subprocess.run(["chattr", "+i", str(ckpt_dir)], check=True)
        failing["on"] = True


def main(argv):
    cfg = make_cfg(f"train.steps={steps}", "checkpoint.save_every=2", "checkpoint.keep=2", output_dir=str(run_dir))
    run_experiment(cfg, resume=resume, progress=False, mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]),
                   loaded=tiny_base(), batcher=SyntheticBatcher(), on_step=on_step)
    return 0


try:
    code = run_cli(main, [])
    _end_process(code)
finally:
    if immutable:
        subprocess.run(["chattr", "-i", str(ckpt_dir)], capture_output=True)
sys.exit(code)
