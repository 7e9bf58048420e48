"""What a standing federation admits of a valid config (crossdc/orchestration/submission.py), on small exact cases:
checkpoint folders and URLs confined to the service's roots, and only enrolled, active datacenters. Over HTTP:
tests/test_api_security.py; from the command line: tests/test_cli_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossdc.experiment.config import parse_config
from crossdc.orchestration.submission import (
    SubmissionRefused,
    confine_checkpoint_dir,
    enrollment_state,
    refuse_unenrolled,
    resolve_checkpoint_roots,
    with_checkpoint_dir,
)


@pytest.fixture
def roots(tmp_path: Path) -> tuple[str, ...]:
    """A local root (holding a folder and a symlink that leaves it), then two URL roots."""
    local = tmp_path / "root"
    (local / "sub").mkdir(parents=True)
    (local / "escape").symlink_to(tmp_path)
    return resolve_checkpoint_roots([str(local), "s3://bucket/ckpt/", "memory://crossdc"], tmp_path / "unused")


def test_checkpoint_dirs_inside_a_root_are_made_absolute(roots: tuple[str, ...]) -> None:
    local = roots[0]
    assert roots[1:] == ("s3://bucket/ckpt", "memory://crossdc")
    for given, meant in (("checkpoints/", f"{local}/checkpoints"), ("sub", f"{local}/sub"), (local, local),
                         (f"{local}/sub/x", f"{local}/sub/x"),
                         (f"file://{local}/a", f"{local}/a"), ("~x", f"{local}/~x"),
                         ("s3://bucket/ckpt", "s3://bucket/ckpt"), ("s3://bucket/ckpt/exp/", "s3://bucket/ckpt/exp"),
                         ("S3://bucket/ckpt/exp", "s3://bucket/ckpt/exp"), ("memory://crossdc/a", "memory://crossdc/a")):
        assert confine_checkpoint_dir(given, roots) == meant, given


@pytest.mark.parametrize(("given", "why"), [
    ("/etc", "is outside every checkpoint root"),
    ("../x", "may not contain '..'"),
    ("sub/../../x", "may not contain '..'"),
    ("escape", "is outside every checkpoint root"),  # a symlink inside the root that leads out of it
    ("escape/deeper", "is outside every checkpoint root"),
    ("s3://bucket/other", "is outside every checkpoint root"),
    ("s3://bucket/ckptx", "is outside every checkpoint root"),  # a prefix of a segment is not the segment
    ("gs://bucket/ckpt/x", "is outside every checkpoint root"),
    ("s3://bucket/ckpt/../x", "has a '..'"),
    ("s3://bucket//ckpt/x", "has a '..'"),
    ("s3://bucket/ckpt/x?versionId=1", "has a '..'"),
    ("simplecache::s3://bucket/ckpt/x", "is neither a path nor a URL"),
    ("a/b://c", "is neither a path nor a URL"),
    ("file://host/x", "is not a file:///absolute/path"),
    ("x\x00y", "is not a path"),
])
def test_checkpoint_dirs_elsewhere_are_refused_in_one_line(roots: tuple[str, ...], given: str, why: str) -> None:
    with pytest.raises(SubmissionRefused) as refused:
        confine_checkpoint_dir(given, roots)
    message = str(refused.value)
    assert message.startswith(f"'checkpoint.dir' = {given!r} {why}") and "\n" not in message
    assert message.endswith(f"this service's checkpoint roots: {', '.join(roots)} (a relative path goes under the first)")


def test_roots_default_to_the_runs_folder_and_a_url_root_takes_relative_paths(tmp_path: Path) -> None:
    assert resolve_checkpoint_roots([], tmp_path / "runs") == (str((tmp_path / "runs").resolve()),)
    url_first = resolve_checkpoint_roots(["s3://bucket/p", str(tmp_path)], tmp_path)
    assert confine_checkpoint_dir("exp/ckpt", url_first) == "s3://bucket/p/exp/ckpt"
    assert confine_checkpoint_dir(str(tmp_path / "x"), url_first) == str((tmp_path / "x").resolve())
    for bad in ("", "s3://", "s3://b/../c", "s3://b?x", "file://host/x"):
        with pytest.raises(ValueError, match="--checkpoint-root"):
            resolve_checkpoint_roots([bad], tmp_path)


def test_the_admitted_config_names_the_folder_in_its_section_and_its_toml() -> None:
    doc = {"run": {"rounds": 1}, "workload": {"dataset": "synthetic"}, "strategy": {"name": "fedavg"},
           "datacenters": [{"name": "a"}], "checkpoint": {"every_rounds": 1}}
    moved = with_checkpoint_dir(parse_config(doc), "/srv/ckpt")
    assert moved.checkpoint.dir == "/srv/ckpt" and moved.raw["checkpoint"] == {"every_rounds": 1, "dir": "/srv/ckpt"}
    assert "dir" not in doc["checkpoint"]  # the caller's document is left alone
    without = with_checkpoint_dir(parse_config({k: v for k, v in doc.items() if k != "checkpoint"}), "/srv/ckpt")
    assert without.checkpoint.dir == "/srv/ckpt" and "checkpoint" not in without.raw  # no checkpoints: no table added


def test_only_enrolled_active_datacenters_may_run() -> None:
    rows = {"on": {"status": "active", "node_id": "12"}, "seen": {"status": "active", "node_id": None},
            "paused": {"status": "suspended", "node_id": None}, "gone": {"status": "revoked", "node_id": None}}
    states = {name: enrollment_state(row) for name, row in rows.items()}
    assert states == {"on": "active", "seen": "not enrolled", "paused": "suspended", "gone": "revoked"}
    refuse_unenrolled(["on"], states)
    with pytest.raises(SubmissionRefused) as refused:
        refuse_unenrolled(["on", "gone", "seen", "paused", "new"], states)
    assert str(refused.value) == ("datacenters not enrolled and active at this federation: gone (revoked), seen (not "
                                  "enrolled), paused (suspended), new (unknown); enroll them (`crossdc enroll`) or leave "
                                  "them out of [[datacenters]]")
