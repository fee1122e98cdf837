"""What one node checks of the run's folder and files (pipeline.run.shared_paths.node_problems): the token the
driver wrote, read back, and each file there; every odd case is a problem named, never an exception.
tests/integration/test_multinode.py runs the whole check on real nodes."""

from __future__ import annotations

from pathlib import Path

from pipeline.run.shared_paths import TOKEN_FILE, node_problems


def test_a_node_that_sees_the_drivers_folder_and_files_has_no_problem(tmp_path: Path):
    (tmp_path / TOKEN_FILE).write_text("t0")
    (tmp_path / "d.jsonl").write_text("{}\n")
    assert node_problems(str(tmp_path), "t0", [str(tmp_path / "d.jsonl"), str(tmp_path)]) == []


def test_another_folder_at_the_same_path_is_named(tmp_path: Path):
    assert node_problems(str(tmp_path), "t0", []) == [
        f"the output folder {tmp_path} does not have the driver's check file: it is not the driver's folder"]
    (tmp_path / TOKEN_FILE).write_text("t-older")  # a copy of the folder, or another run's check
    assert "holds another run's check file" in node_problems(str(tmp_path), "t0", [])[0]
    (tmp_path / TOKEN_FILE).write_bytes(b"\xff\xfe")
    assert len(node_problems(str(tmp_path), "t0", [])) == 1
    assert len(node_problems(str(tmp_path / "nowhere"), "t0", [])) == 1


def test_each_missing_file_is_named(tmp_path: Path):
    (tmp_path / TOKEN_FILE).write_text("t0")
    assert node_problems(str(tmp_path), "t0", ["/no/such/a.jsonl", str(tmp_path), "/no/model"]) == [
        "/no/such/a.jsonl is missing", "/no/model is missing"]
