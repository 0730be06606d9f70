"""Bad input is refused before any work starts: one line naming the option, exit code 2, nothing written.

Each row is a mistake a user made (or a tester tried): the command as typed,
and the words the one-line error must contain. A wrong value never becomes a
traceback, a hang, a silently relabelled result or a page written elsewhere.
"""

import os

import pytest

from lab.cli import main


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.hlo").write_bytes(b"\x00\x01\xff\xfe\x80 binary")
    (tmp_path / "empty.hlo").write_text("")
    (tmp_path / "prose.hlo").write_text("not an HLO module\n" * 100)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    return tmp_path


CASES = [
    (["inspect", "--dtype", "float33"], "not an element type"),
    (["inspect", "--dtype", "object"], "not an element type"),
    (["inspect", "--dtype", "float64"], "JAX_ENABLE_X64"),
    (["bench", "--dtype", "float64"], "JAX_ENABLE_X64"),
    (["inspect", "--hlo", "{tmp}/binary.hlo"], "not text"),
    (["inspect", "--hlo", "{tmp}/empty.hlo"], "holds no HLO module"),
    (["inspect", "--hlo", "{tmp}/prose.hlo"], "holds no HLO module"),
    (["inspect", "--hlo", "/dev/zero"], "not a regular file"),
    (["inspect", "--hlo", "{tmp}/a_folder"], "not a regular file"),
    (["inspect", "--dump", "{tmp}/a_file"], "is a file"),
    (["inspect", "--target", "cpu:100000"], "at most 512"),
    (["inspect", "--target", "cpu:٨"], "positive integer"),
    (["bench", "-n", "0"], "--iters 0: must be at least 1"),
    (["bench", "-n", "-1"], "--iters -1: must be at least 1"),
    (["train", "--learning-rate", "nan"], "--learning-rate nan: must be a finite number"),
    (["train", "--learning-rate", "inf"], "must be a finite number"),
    (["train", "--learning-rate", "-1"], "must be positive"),
    (["train", "--learning-rate", "1e30"], "must be at most 1"),
    (["train", "--input-ms", "nan"], "--input-ms nan"),
    (["train", "--input-ms", "1e308"], "--input-ms 1e+308: must be at most 60000"),
    (["train", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["train", "--seed", str(2**65)], "--seed"),
    (["train", "--steps", "100000000000"], "--steps"),
    (["train", "--global-batch", "100000000"], "more than a quarter of this host"),
    (["train", "--log", "{tmp}/a_folder"], "--log"),
    (["train", "--results", "{tmp}/a_file"], "is a file"),
    (["train", "--name", ""], "--name ''"),
    (["train", "--name", "../../x"], "plain folder name"),
    (["train", "--target", "tpu:v5e:2x2"], "compile-only"),
    (["run", "collectives", "--repeats", "0"], "--repeats 0: must be at least 1"),
    (["run", "ring_allreduce", "--group-sizes", "16"], "no ring size in [16] fits on 8 devices"),
    (["run", "stage_imbalance", "--repeats", "-2"], "--repeats -2: must be at least 1"),
    (["run", "layout_plans", "--full-size", "-1"], "--full-size -1: must be at least 0"),  # 0: no full-size compiles
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_mistake_is_one_line_and_exit_2_and_writes_nothing(capsys, devices, files, argv, words):
    before = sorted(os.listdir(files))
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(os.listdir(files)) == before
