"""packer's folder scan against torchvision ImageFolder's rules, written out independently in conftest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packer.errors import SourceError
from packer.sources.folder import scan_folder


def touch(root: Path, *relpaths: str) -> None:
    for rel in relpaths:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not decoded by the scan")


def assert_matches_reference(result, reference) -> None:
    classes, class_to_idx, samples = reference
    assert result.classes == classes
    assert result.class_to_idx == class_to_idx
    assert result.samples == samples


def test_sample_data_is_imagefolder(sample_data, reference_scan):
    result = scan_folder(sample_data)
    reference = reference_scan(sample_data)
    assert_matches_reference(result, reference)
    assert result.classes == ["astronaut", "cat", "coffee", "galaxy", "rocket"]
    assert len(result.samples) == 150
    assert result.hidden_skipped == 0 and result.empty_classes == [] and result.errors == []


@pytest.fixture
def tricky_tree(tmp_path) -> Path:
    root = tmp_path / "src"
    touch(root,
          # every extension, in every case
          "b_class/img0.jpg", "b_class/IMG1.JPG", "b_class/img2.Jpeg", "b_class/img3.PNG", "b_class/img4.ppm",
          "b_class/img5.BMP", "b_class/img6.pgm", "b_class/img7.tif", "b_class/img8.TIFF", "b_class/img9.webp",
          # not images
          "b_class/notes.txt", "b_class/img.jpg.txt", "b_class/noext", "b_class/img.gif", "b_class/img.svg",
          # nested folders, sorted as whole os.walk paths: "a" < "a b" < "a/b" < "a_b"
          "A_upper/z.png", "A_upper/a/b/deep.jpg", "A_upper/a b/x.jpg", "A_upper/a/y.jpg", "A_upper/a_b/w.jpg",
          "A_upper/0.jpg",
          # non-ASCII and spaces
          "ünïcödé class/çà et là.jpg", "ünïcödé class/日本語 ファイル.png", "ünïcödé class/ space first.jpg",
          # a file at the top level is not a class
          "stray.jpg")
    return root


def test_tricky_tree_matches_imagefolder(tricky_tree, reference_scan):
    result = scan_folder(tricky_tree)
    assert_matches_reference(result, reference_scan(tricky_tree))
    # spot checks that the reference itself says what ImageFolder says
    assert result.classes == ["A_upper", "b_class", "ünïcödé class"]
    rels = [r for r, _ in result.samples]
    assert "stray.jpg" not in rels and "b_class/notes.txt" not in rels and "b_class/img.gif" not in rels
    assert sum(r.startswith("b_class/") for r in rels) == 10
    assert rels[:6] == ["A_upper/0.jpg", "A_upper/z.png", "A_upper/a/y.jpg", "A_upper/a b/x.jpg",
                        "A_upper/a/b/deep.jpg", "A_upper/a_b/w.jpg"]


def test_symlinked_folders_are_followed(tmp_path, reference_scan):
    outside = tmp_path / "outside"
    touch(outside, "linked_class/l1.jpg", "nested/n1.png", "nested/n2.jpg")
    root = tmp_path / "src"
    touch(root, "cat/c1.jpg")
    os.symlink(outside / "linked_class", root / "dog")
    os.symlink(outside / "nested", root / "cat" / "more")
    result = scan_folder(root)
    assert_matches_reference(result, reference_scan(root))
    assert result.samples == [("cat/c1.jpg", 0), ("cat/more/n1.png", 0), ("cat/more/n2.jpg", 0), ("dog/l1.jpg", 1)]


def test_symlink_loop_is_reported_not_followed_forever(tmp_path):
    root = tmp_path / "src"
    touch(root, "cat/c1.jpg", "cat/sub/c2.jpg")
    os.symlink(root / "cat", root / "cat" / "sub" / "loop")
    result = scan_folder(root)
    assert result.samples[:2] == [("cat/c1.jpg", 0), ("cat/sub/c2.jpg", 0)]
    assert any("loop" in why for _, why in result.errors)


def test_hidden_entries_are_skipped_and_counted(tmp_path, reference_scan):
    root = tmp_path / "src"
    touch(root, ".ipynb_checkpoints/x.jpg", "cat/.DS_Store", "cat/.hidden.jpg", "cat/.cache/in_hidden.jpg",
          "cat/.cache/.deeper/y.jpg", "cat/ok.jpg", "dog/ok.png")
    result = scan_folder(root)
    assert_matches_reference(result, reference_scan(root))
    assert result.classes == ["cat", "dog"]
    assert result.samples == [("cat/ok.jpg", 0), ("dog/ok.png", 1)]
    # .ipynb_checkpoints, .DS_Store, .hidden.jpg, .cache (not descended into)
    assert result.hidden_skipped == 4


def test_include_hidden_is_exactly_imagefolder(tmp_path, reference_scan):
    root = tmp_path / "src"
    touch(root, ".ipynb_checkpoints/x.jpg", "cat/.hidden.jpg", "cat/.cache/in_hidden.jpg", "cat/ok.jpg")
    result = scan_folder(root, include_hidden=True)
    assert_matches_reference(result, reference_scan(root, include_hidden=True))
    assert result.classes == [".ipynb_checkpoints", "cat"]
    assert ("cat/.cache/in_hidden.jpg", 1) in result.samples and ("cat/.hidden.jpg", 1) in result.samples
    assert result.hidden_skipped == 0


def test_empty_class_keeps_its_index(tmp_path, reference_scan):
    root = tmp_path / "src"
    touch(root, "a/1.jpg", "c/2.jpg", "b/readme.txt")
    (root / "d_empty").mkdir()
    result = scan_folder(root)
    assert_matches_reference(result, reference_scan(root))
    assert result.class_to_idx == {"a": 0, "b": 1, "c": 2, "d_empty": 3}
    assert result.samples == [("a/1.jpg", 0), ("c/2.jpg", 2)]
    assert result.empty_classes == ["b", "d_empty"]


def test_missing_source(tmp_path):
    with pytest.raises(SourceError, match="does not exist") as info:
        scan_folder(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_source_is_a_file(tmp_path):
    (tmp_path / "f.jpg").write_bytes(b"x")
    with pytest.raises(SourceError, match="not a folder"):
        scan_folder(tmp_path / "f.jpg")


def test_source_without_class_folders(tmp_path):
    touch(tmp_path, "a.jpg", "b.png")
    with pytest.raises(SourceError, match="no class folders") as info:
        scan_folder(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_source_without_images(tmp_path):
    touch(tmp_path, "cat/readme.txt", "dog/.hidden.jpg")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no images") as info:
        scan_folder(tmp_path)
    assert str(tmp_path) in str(info.value)
