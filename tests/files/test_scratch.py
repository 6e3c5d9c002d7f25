"""`gated_qwen.files.scratch`, in one process (the killed runs of real processes: tests/analysis/test_workers.py): a
live run's scratch folder (its owner record locked) is left alone and said to be; one whose run ended (the record's
lock free) is removed, and so is an empty one that a run killed before it wrote its record left; a folder without
this project's record is not touched. TMPDIR and the record of scratch places are this test's own."""

import json
import os
import socket
import tempfile

import pytest

from gated_qwen.files import clean_stale_scratch, scratch_folder
from gated_qwen.files.staging import OWNER_FILE


@pytest.fixture
def tmpdir_of_its_own(tmp_path, monkeypatch):
    place = tmp_path / "tmp"
    place.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(place))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return place


def test_a_live_runs_scratch_is_left_alone_and_an_ended_runs_is_removed(tmpdir_of_its_own, capsys):
    place = tmpdir_of_its_own
    ended = place / "gated-qwen-trainer-ended"  # as a killed run leaves it: its record, the lock released
    ended.mkdir()
    (ended / OWNER_FILE).write_text(json.dumps({"by": "gated-qwen", "kind": "scratch", "pid": 1,
                                                "host": socket.gethostname()}))
    (ended / "checkpoint").write_text("x")
    empty = place / "gated-qwen-trainer-empty"  # killed before it wrote its record
    empty.mkdir()
    theirs = place / "gated-qwen-notes"  # a user's folder with that prefix
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")

    with scratch_folder("trainer") as live:  # the run that makes one cleans first: the ended one, the empty one
        said = capsys.readouterr().err
        assert f"removed the scratch folder {ended} (process 1 on {socket.gethostname()} has ended)" in said
        assert f"removed the empty scratch folder {empty}" in said
        (live / "checkpoint").write_text("y")
        assert sorted(place.iterdir()) == sorted([live, theirs])
        assert clean_stale_scratch() == [f"left {live} alone: its run (process {os.getpid()} on "
                                         f"{socket.gethostname()}) is still going"]
        assert (live / "checkpoint").read_text() == "y"
    assert sorted(place.iterdir()) == [theirs] and (theirs / "notes.txt").read_text() == "mine"
    assert clean_stale_scratch() == []
