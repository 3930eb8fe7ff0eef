"""The eval results store on SQLite and on a real PostgreSQL server (Debian's package, a cluster
of its own started here in a temp dir on a free port), and the paired regression test's numbers.
No model: the runs are written as the runner writes them."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.evals.regression import compare, confidence_interval, mcnemar_exact
from jaxserve.evals.runner import version_id
from jaxserve.evals.store import ResultsStore, Run, Sample, open_store
from jaxserve.evals.suite import RegressionConfig, load_suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _postgres_bin() -> Path:
    """Debian keeps the server's programs under /usr/lib/postgresql/<major>/bin, off PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    if shutil.which("initdb") and shutil.which("postgres"):
        return Path(shutil.which("initdb")).parent
    pytest.skip("PostgreSQL is not installed (Debian's postgresql package; make system-deps)")


@pytest.fixture(scope="module")
def postgres_dsn():
    bin_dir = _postgres_bin()
    # postgres refuses to run as root: the cluster belongs to `nobody` when the tests are root.
    user = "nobody" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="jaxserve-pg-"))
    if user:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    data = root / "data"
    init = subprocess.run([bin_dir / "initdb", "-D", data, "-A", "trust", "-U", "postgres",
                           "--no-sync", "-E", "UTF8"], user=user, capture_output=True, text=True)
    assert init.returncode == 0, init.stderr[-2000:]
    port = _free_port()
    log = open(root / "log", "w")
    server = subprocess.Popen(
        [bin_dir / "postgres", "-D", data, "-p", str(port), "-k", root, "-c",
         "listen_addresses=127.0.0.1", "-c", "fsync=off"], user=user, stdout=log, stderr=log)
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    import psycopg

    deadline = time.monotonic() + 60
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            break
        except psycopg.OperationalError:
            assert server.poll() is None, (root / "log").read_text()[-2000:]
            assert time.monotonic() < deadline, "postgres did not start"
            time.sleep(0.2)
    yield dsn
    server.terminate()
    server.wait(30)
    log.close()
    shutil.rmtree(root, ignore_errors=True)


def _run(key: str, version: str, score: float, n: int) -> Run:
    return Run(key, "s", version, f"{version}@http://x/v1", "qa", "exact_match", score, n, 7,
               {"limit": None}, 1.0, 2.0)


def _samples(correct: list[float]) -> list[Sample]:
    return [Sample(i, f"h{i}", c, f"t{i}", f"r{i}") for i, c in enumerate(correct)]


def _roundtrip(store: ResultsStore) -> None:
    base = [1.0] * 20
    worse = [1.0] * 10 + [0.0] * 10
    assert store.add_run(_run("k1", "v1", 1.0, 20), _samples(base))
    assert store.add_run(_run("k2", "v2", 0.5, 20), _samples(worse))
    # A second runner finishing the same pair is not an error and stores nothing twice.
    assert not store.add_run(_run("k2", "v2", 0.5, 20), _samples(worse))
    runs = store.runs("s")
    assert [r.version for r in runs] == ["v1", "v2"] and store.runs("other") == []
    assert store.run("k1").settings == {"limit": None} and store.run("nope") is None
    got = store.samples(store.run("k2").id)
    assert got == _samples(worse)
    c = compare("qa", "exact_match", "v1", store.samples(runs[0].id), "v2", got,
                RegressionConfig())
    assert c.alert and c.drop_points == pytest.approx(50.0) and c.lost == tuple(range(10, 20))
    # A `via = "batch"` run's batches: recorded, and replaced when submitted again.
    assert store.batch_id("k3:abc") is None
    store.record_batch("k3:abc", "batch_1")
    store.record_batch("k3:abc", "batch_2")
    assert store.batch_id("k3:abc") == "batch_2"


def test_sqlite_store_roundtrip_and_resume_key(tmp_path):
    with open_store("results/evals.sqlite", tmp_path) as store:
        _roundtrip(store)
    assert (tmp_path / "results" / "evals.sqlite").exists()
    with open_store(tmp_path / "results" / "evals.sqlite") as store:  # reopened: still there
        assert len(store.runs()) == 2


def test_postgres_store_roundtrip(postgres_dsn):
    with ResultsStore(postgres_dsn) as store:
        _roundtrip(store)
    with ResultsStore(postgres_dsn) as store:  # a second runner sees the first one's runs
        assert [r.run_key for r in store.runs("s")] == ["k1", "k2"]


def test_mcnemar_numbers_and_thresholds():
    # 6 lost, 0 gained: p = 2 * 0.5**6 = 0.03125 (exact, two-sided)
    assert mcnemar_exact(6, 0) == pytest.approx(0.03125)
    assert mcnemar_exact(0, 0) == 1.0
    base = _samples([1.0] * 100)
    six_lost = _samples([0.0] * 6 + [1.0] * 94)
    c = compare("qa", "acc", "a", base, "b", six_lost, RegressionConfig())
    assert c.alert and c.drop_points == pytest.approx(6.0) and c.p_value == pytest.approx(0.03125)
    # The same drop below the configured points, or not significant at the level: no alert.
    assert not compare("qa", "acc", "a", base, "b", six_lost,
                       RegressionConfig(min_drop_points=7)).alert
    assert not compare("qa", "acc", "a", base, "b", six_lost, RegressionConfig(alpha=0.01)).alert
    # Noise: 3 lost and 2 gained is a 1-point drop and not significant.
    noisy = _samples([0.0] * 3 + [1.0] * 97)
    noisy_base = _samples([1.0] * 3 + [0.0] * 2 + [1.0] * 95)
    c = compare("qa", "acc", "a", noisy_base, "b", noisy, RegressionConfig())
    assert c.drop_points == pytest.approx(1.0) and c.p_value > 0.5 and not c.alert
    # Only questions in both runs count.
    assert compare("qa", "acc", "a", base[:50], "b", six_lost, RegressionConfig()).paired == 50


def test_paired_bootstrap_for_graded_scores_is_seeded():
    base = _samples([0.9] * 60)
    worse = _samples([0.5] * 60)
    config = RegressionConfig(bootstrap_samples=2000)
    c = compare("qa", "f1", "a", base, "b", worse, config)
    assert c.test == "paired-bootstrap" and c.alert and c.drop_points == pytest.approx(40.0)
    mixed = _samples([0.9, 0.1] * 30)
    flipped = _samples([0.1, 0.9] * 30)
    c1 = compare("qa", "f1", "a", mixed, "b", flipped, config)
    assert not c1.alert and c1.p_value == compare("qa", "f1", "a", mixed, "b", flipped,
                                                  config).p_value


def test_confidence_interval():
    low, high = confidence_interval([1.0] * 8 + [0.0] * 2)
    assert 0.4 < low < 0.8 < high < 1.0  # Wilson's, not clipped at 1
    assert confidence_interval([]) == (0.0, 0.0)


def _suite(tmp_path, text: str) -> Path:
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return path


GOOD = """
name = "s"
[[tasks]]
name = "arc_easy"
[[versions]]
name = "v1"
url = "http://127.0.0.1:8000/v1"
model = "m"
"""


@pytest.mark.parametrize("change, message", [
    ("alpa = 0.05\n", "unknown key(s) alpa"),
    ("[regression]\nalpha = 2\n", "regression.alpha"),
    ("[regression]\nmin_drop_points = -1\n", "regression.min_drop_points"),
    ("limit = 0\n", "suite.limit"),
    ("[[tasks]]\npath = \"missing.yaml\"\n", "tasks[1].path"),
    ("[[tasks]]\nname = \"arc_easy\"\n", "suite.tasks: names repeat"),
    ("[[versions]]\nname = \"v2\"\nurl = \"file:///etc/passwd\"\nmodel = \"m\"\n",
     "versions[1].url"),
    ("[[versions]]\nname = \"v2\"\nurl = \"http://h/v1\"\nmodel = \"m\"\napi = \"x\"\n",
     "versions[1].api"),
    ("[[versions]]\nname = \"../x\"\nurl = \"http://h/v1\"\nmodel = \"m\"\n",
     "versions[1].name"),
    ("[[versions]]\nname = \"v2\"\nurl = \"http://h/v1\"\npath = \"m.gguf\"\n",
     "versions[1]: give exactly one of url"),
    ("[[versions]]\nname = \"v2\"\n", "versions[1]: give exactly one of url"),
    ("[[versions]]\nname = \"v2\"\nurl = \"http://h/v1\"\n", "versions[1].model: required"),
    ("[[versions]]\nname = \"v2\"\npath = \"m.gguf\"\nmodel = \"m\"\n",
     "versions[1].model: only with url"),
    ("[[versions]]\nname = \"v2\"\npath = \"m.gguf\"\nengine = {max_len = 1}\n",
     "versions[1].engine: unknown setting(s) max_len"),
    ("[[versions]]\nname = \"v2\"\ndeployment = \"d.toml\"\nengine = {}\n",
     "versions[1].engine: only with path"),
    ("[[versions]]\nname = \"v2\"\ndeployment = \"missing.toml\"\n",
     "versions[1].deployment: no file"),
    ("[[versions]]\nname = \"v2\"\nurl = \"http://h/v1\"\nmodel = \"m\"\nvia = \"mail\"\n",
     "versions[1].via: want one of live, batch"),
    ("[[versions]]\nname = \"v2\"\npath = \"m.gguf\"\nvia = \"batch\"\n",
     "versions[1].via: \"batch\" needs url"),
])
def test_suite_errors_name_the_field(tmp_path, change, message):
    text = GOOD.replace('name = "s"\n', 'name = "s"\n' + change) if change.startswith(
        ("alpa", "limit")) else GOOD + change
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]")):
        load_suite(_suite(tmp_path, text))


def test_suite_defaults(tmp_path):
    suite = load_suite(_suite(tmp_path, GOOD))
    assert suite.regression.min_drop_points == 1.0 and suite.regression.alpha == 0.05
    assert suite.store == "evals.sqlite" and suite.seed == 1234 and suite.limit is None
    assert version_id(suite.versions[0], None) == "m@http://127.0.0.1:8000/v1"


def test_in_process_versions_parse(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "deploy.toml").write_text("")
    suite = load_suite(_suite(tmp_path, GOOD + """
[[versions]]
name = "local"
path = "m.gguf"
engine = {max_model_len = 512, deterministic = true}
[[versions]]
name = "registered"
path = "smollm2-135m-instruct"
[[versions]]
name = "smol-v2"
deployment = "deploy.toml"
"""))
    url, local, registered, fleet = suite.versions
    assert not url.in_process and local.in_process and fleet.in_process
    assert (local.path, local.model) == (str(tmp_path / "m.gguf"), "local")
    assert local.engine == (("deterministic", True), ("max_model_len", 512))
    assert registered.path == "smollm2-135m-instruct"  # no such file: a registered name
    assert fleet.deployment == tmp_path / "deploy.toml" and fleet.model == "smol-v2"
    assert local.settings()["engine"] == {"deterministic": True, "max_model_len": 512}
    assert "url" not in url.settings()  # the run keys of stored url versions do not change
    assert "via" not in url.settings() and url.via == "live"  # nor those of live ones
    with pytest.raises(ConfigError, match="no url, and this runner serves no version"):
        version_id(local, None)


def test_example_suite_parses():
    suite = load_suite(Path(__file__).resolve().parents[1] / "configs" / "evals" / "suite.toml")
    assert [v.name for v in suite.versions] == ["smollm2-base", "smollm2-misled"]
    assert suite.tasks[0].name == "capitals" and suite.tasks[0].path.is_file()
