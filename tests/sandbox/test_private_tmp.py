"""Each call's own /tmp and /dev/shm (quota, privacy, gone at the end) and multiprocessing."""
from __future__ import annotations

import os

import pytest

from sandbox.isolation import interpreter_dirs_under
from sandbox.launcher import health

TMP_MB = 128  # the server default (--tmp-mb)


@pytest.fixture(scope="module", autouse=True)
def private(server_url):
  if not health(server_url)["private_tmp"]:
    pytest.skip("no private /tmp per call here (needs root)")


def _shmem_mb() -> float:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("Shmem:"):
        return int(line.split()[1]) / 1024
  raise AssertionError("no Shmem in /proc/meminfo")


def test_tmp_and_shm_are_private_writable_and_empty(client):
  code = ("import os, time, tempfile\nbefore = (sorted(os.listdir('/tmp')), os.listdir('/dev/shm'))\n"
          "open('/tmp/mine', 'w').write('{i}')\nopen('/dev/shm/mine', 'w').write('{i}')\n"
          "with tempfile.NamedTemporaryFile(dir='/tmp') as t:\n  t.write(b'x')\n"
          "time.sleep(0.3)\n"
          "print(before, open('/tmp/mine').read(), open('/dev/shm/mine').read(), sorted(os.listdir('/tmp')),"
          " tempfile.gettempdir(), os.getcwd(), oct(os.stat('/tmp').st_mode & 0o777))")
  rs = client.execute([{"code": code.format(i=i)} for i in range(24)])
  own = sorted({p.split("/")[2] for p in interpreter_dirs_under("/tmp")})  # a venv under /tmp
  for i, r in enumerate(rs):
    assert (r.status, r.stdout) == (
        "ok", f"({own}, []) {i} {i} {sorted(own + ['mine'])} /tmp /tmp 0o700\n"), r
  assert not os.path.exists("/dev/shm/mine")  # the host's /dev/shm never saw it


def test_a_full_tmp_is_enospc_for_that_call_only(client):
  filler = ("import errno\nn = 0\ntry:\n  for i in range(10):\n"
            "    with open(f'/tmp/f{i}', 'wb') as f:\n      for _ in range(60):\n"
            "        f.write(b'x' * (1 << 20))\n        n += 1\n"
            "except OSError as e:\n  print(n, errno.errorcode[e.errno])")
  writer = ("import time\ntime.sleep(0.2)\nwith open('/tmp/data', 'wb') as f:\n"
            "  for _ in range(50):\n    f.write(b'y' * (1 << 20))\n"
            "import os\nprint(os.path.getsize('/tmp/data') >> 20)")
  rs = client.execute([{"code": filler, "timeout": 20}] * 2
                      + [{"code": writer, "timeout": 20}] * 8)
  for r in rs[:2]:
    assert r.status == "ok" and r.stdout.split()[1] == "ENOSPC", r
    assert TMP_MB - 8 <= int(r.stdout.split()[0]) <= TMP_MB, r
  assert [(r.status, r.stdout) for r in rs[2:]] == [("ok", "50\n")] * 8


def test_files_are_freed_when_the_call_ends(client):
  write = ("for i in range(2):\n  with open(f'/tmp/f{i}', 'wb') as f:\n"
           "    f.write(b'z' * (50 << 20))\n"
           "with open('/dev/shm/s', 'wb') as f:\n  f.write(b'z' * (40 << 20))\nprint('written')")
  before = _shmem_mb()
  for _ in range(5):  # 700 MB written in all; kept, it would show in the host's Shmem
    (r,) = client.execute([{"code": write, "timeout": 20}])
    assert (r.status, r.stdout) == ("ok", "written\n"), r
  assert _shmem_mb() - before < 150


def test_sysv_shared_memory_is_the_calls_own_and_goes_with_it(client, run):
  # A segment outlived its call: the next calls could read it, and its pages stayed
  # charged to the calls' memory budget.
  make = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "libc.shmat.restype = ctypes.c_void_p\n"
          "sid = libc.shmget(0x5EED, 16 << 20, 0o1000 | 0o666)\n"
          "ctypes.memset(libc.shmat(sid, None, 0), 0x41, 16 << 20)\nprint(sid >= 0)")
  assert [(r.status, r.stdout) for r in client.execute([{"code": make}] * 3)] == \
      [("ok", "True\n")] * 3
  r = run("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "print(open('/proc/sysvipc/shm').read().count('\\n') - 1, libc.shmget(0x5EED, 0, 0))")
  assert (r.status, r.stdout) == ("ok", "0 -1\n"), r


def test_multiprocessing_works_inside_a_call(run):
  r = run("import multiprocessing as mp\ndef sq(x):\n  return x * x\n"
          "with mp.Pool(2) as p:\n  print(p.map(sq, range(6)))", timeout=20)
  assert (r.status, r.stdout) == ("ok", "[0, 1, 4, 9, 16, 25]\n"), r
  r = run("from concurrent.futures import ProcessPoolExecutor\ndef cube(x):\n  return x ** 3\n"
          "with ProcessPoolExecutor(2) as ex:\n  print(list(ex.map(cube, range(4))))", timeout=20)
  assert (r.status, r.stdout) == ("ok", "[0, 1, 8, 27]\n"), r
  r = run("import multiprocessing as mp\nq = mp.Queue()\nlock = mp.Lock()\n"
          "p = mp.Process(target=q.put, args=(42,))\np.start()\nwith lock:\n  print(q.get())\np.join()",
          timeout=20)
  assert (r.status, r.stdout) == ("ok", "42\n"), r


def test_too_many_processes_fail_clearly_not_hang(run):
  r = run("import multiprocessing as mp\ndef f(x):\n  return x\n"
          "with mp.Pool(200) as p:\n  print(p.map(f, range(10)))", timeout=25)
  # The call's uid may run 64 processes: the fork fails, the Pool raises, the call ends.
  assert (r.status, r.error_type, r.error_line) == ("error", "BlockingIOError", 4), r


def test_environment_is_the_calls_own_and_does_not_leak(client):
  # The warm parent sets the calls' environment once (children no longer rebuild it):
  # every call still sees exactly that environment, HOME and TMPDIR its private /tmp,
  # and what a call changes in it is gone for the next call.
  from sandbox.worker import _child_env
  code = ("import os, json\nenv = dict(os.environ)\nos.environ['LEAK'] = '1'\nos.environ['HOME'] = '/x'\n"
          "os.putenv('PATH', '/nowhere')\nprint(json.dumps(env, sort_keys=True))")
  want = _child_env("/tmp")
  want["PATH"] = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
  rs = client.execute([{"code": code} for _ in range(12)])
  for r in rs:
    assert r.status == "ok", r
    got = __import__("json").loads(r.stdout)
    assert got.keys() == want.keys(), got
    assert {k: got[k] for k in want if k != "PATH"} == {k: v for k, v in want.items() if k != "PATH"}
    assert got["HOME"] == got["TMPDIR"] == "/tmp"


def test_an_interpreter_under_tmp_stays_usable_and_read_only(tmp_path_factory):
  """A virtualenv made under /tmp: the private /tmp of bwrap and of every call would
  hide it; its directory is bound back read-only, so the server starts, calls import
  from it, and cannot write there."""
  import subprocess
  import sys
  import tempfile
  venv = tempfile.mkdtemp(prefix="venv-under-tmp-", dir="/tmp")
  try:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    venv], check=True)
    py = os.path.join(venv, "bin", "python")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from sandbox.launcher import running_server\n"
            "from sandbox.client import SyncSandboxClient\nimport sys\n"
            "with running_server(max_children=2, pool_size=1) as url:\n"
            "  with SyncSandboxClient([url]) as c:\n"
            "    (r,) = c.execute([{'code': 'import sys, fractions, os\\n"
            "print(sys.prefix, fractions.Fraction(1, 3))\\n"
            "try:\\n  open(sys.prefix + \\'/x\\', \\'w\\')\\nexcept OSError:\\n"
            "  print(\\'refused\\')'}])\n"
            "print(r.status, r.stdout, r.stderr)\n")
    out = subprocess.run([py, "-c", code], cwd=repo, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=repo))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.split() == ["ok", venv, "1/3", "refused"], out.stdout
  finally:
    import shutil
    shutil.rmtree(venv, ignore_errors=True)
