"""--lora-root: a LoadAdapter path names a directory inside the root, relative to it (or absolute inside
it), with symlinks followed; every path that does not is refused in one wording, so a caller cannot
tell a missing directory from one outside, and an adapter is reported by its path relative to the
root."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.common.model_name import echo
from tandem.decoder.models.adapter_files import FileIdentity, FoundFile
from tandem.decoder.models.adapter_root import AdapterRoot, start_up_shown
from tandem.decoder.models.peft_adapter import CONFIG_FILE, MAX_PATH_BYTES
from tandem.decoder.models.peft_weights import WEIGHTS_FILE


def adapter_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text("{}")
    (path / WEIGHTS_FILE).write_bytes(b"")
    return path


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """A root holding adapters 'qv4' and 'team/mlp8', a directory beside it holding one too."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    adapter_dir(root / "qv4")
    adapter_dir(root / "team" / "mlp8")
    adapter_dir(outside / "secret")
    (root / "README").write_text("not an adapter")
    return {"root": root, "outside": outside}


def refusal(root: AdapterRoot, path: str) -> str:
    with pytest.raises(InvalidArgument) as refused:
        root.find(path)
    assert refused.value.field == "path"
    return refused.value.description


def test_a_path_relative_to_the_root_or_absolute_inside_it_is_found_and_shown_relative(
    tree: dict[str, Path],
) -> None:
    root = AdapterRoot(tree["root"])
    for path, shown in (
        ("qv4", "qv4"),
        ("./qv4/", "qv4"),
        ("team//mlp8", "team/mlp8"),
        (str(tree["root"] / "team" / "mlp8"), "team/mlp8"),
    ):
        found = root.find(path)
        assert (found.path, found.shown) == ((tree["root"] / shown).resolve(), shown), path


def test_symlinks_that_stay_inside_the_root_are_followed_and_the_root_may_be_one(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    (tree["root"] / "latest").symlink_to("team/mlp8")
    (tmp_path / "link-to-root").symlink_to(tree["root"])
    root = AdapterRoot(tmp_path / "link-to-root")
    assert root.find("latest").path == (tree["root"] / "team" / "mlp8").resolve()
    assert root.find("latest").shown == "latest"  # the name the caller uses to load it again
    # An absolute path may name the root as the operator wrote it or as it resolves.
    assert root.find(str(tmp_path / "link-to-root" / "qv4")).shown == "qv4"
    assert root.find(str(tree["root"] / "qv4")).shown == "qv4"


def test_an_absolute_symlink_is_followed_where_it_names_the_root_by_either_path(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    # Walked again from the root's descriptor, never by the kernel: a target naming the root by another
    # path (a symlink elsewhere that leads into it) is outside as far as the walk can tell.
    (tmp_path / "link-to-root").symlink_to(tree["root"])
    (tree["root"] / "by-real").symlink_to(tree["root"] / "team" / "mlp8")
    (tree["root"] / "by-given").symlink_to(tmp_path / "link-to-root" / "qv4")
    (tree["root"] / "team" / "back").symlink_to("../qv4")
    (tree["root"] / "team" / "out").symlink_to("../../outside/secret")
    root = AdapterRoot(tmp_path / "link-to-root")
    assert root.find("by-real").found.directory == ("team", "mlp8")
    assert root.find("by-given").found.directory == ("qv4",)
    assert root.find("team/back").found.directory == ("qv4",)
    assert "must name an adapter directory" in refusal(root, "team/out")
    assert "must name an adapter directory" in refusal(AdapterRoot(tree["root"]), "by-given")


def test_find_records_the_file_each_adapter_name_resolves_to_inside_the_root(tree: dict[str, Path]) -> None:
    # The read takes these files only: one swapped in since, a symlink leading out, is refused. The
    # Hugging Face cache's layout (a snapshot's files symlinked into blobs/) records the blobs.
    repo = tree["root"] / "models--team--qv4"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "c0ffee").write_text("{}")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / CONFIG_FILE).symlink_to("../../blobs/c0ffee")
    (repo / "snapshots" / "abc" / WEIGHTS_FILE).symlink_to("../../blobs/missing")  # not fetched yet
    root = AdapterRoot(tree["root"])
    found = root.find("models--team--qv4/snapshots/abc").found
    assert found.directory == ("models--team--qv4", "snapshots", "abc")
    assert found.files == {
        CONFIG_FILE: FoundFile(
            link="../../blobs/c0ffee",
            parts=("models--team--qv4", "blobs", "c0ffee"),
            identity=FileIdentity.of(os.stat(repo / "blobs" / "c0ffee")),
            file_type=stat.S_IFREG,
        )
    }
    plain = tree["root"] / "qv4"
    assert root.find("qv4").found.files == {
        name: FoundFile(
            link=None,
            parts=("qv4", name),
            identity=FileIdentity.of(os.stat(plain / name)),
            file_type=stat.S_IFREG,
        )
        for name in (CONFIG_FILE, WEIGHTS_FILE)
    }


def test_every_path_not_inside_the_root_gets_one_refusal_whatever_is_there(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    root_dir, outside = tree["root"], tree["outside"]
    (root_dir / "out").symlink_to(outside / "secret")  # a directory symlinked out
    (root_dir / "up").symlink_to("..")
    (root_dir / "dangling").symlink_to(tmp_path / "nothing")
    (root_dir / "loop").symlink_to("loop")
    adapter_dir(root_dir / "leaky")
    (root_dir / "leaky" / CONFIG_FILE).unlink()
    (root_dir / "leaky" / CONFIG_FILE).symlink_to(outside / "secret" / CONFIG_FILE)  # a file out
    root = AdapterRoot(root_dir)
    paths = [
        "../outside/secret",  # exists, through '..'
        "qv4/../team/mlp8",  # inside, but through '..' all the same
        "../nothing",  # missing, through '..'
        str(outside / "secret"),  # an absolute path elsewhere that exists
        str(outside / "missing"),  # and one that does not
        str(tmp_path),  # a directory above the root
        "/",
        "out",
        "up/outside/secret",
        "dangling",
        "loop",
        "leaky",
        "missing",  # inside, nothing there
        "qv4/adapter_config.json",  # a file, not a directory
        "README",
        "",  # the root itself
        ".",
        str(root_dir),
    ]
    said = {refusal(root, path).replace(echo(path), "<path>") for path in paths}
    assert said == {
        "must name an adapter directory inside the server's --lora-root, relative to it and without "
        "'..', got <path>"
    }
    assert str(root_dir) not in refusal(root, "out") and str(outside) not in refusal(root, "out")


def test_a_nul_or_an_over_long_path_is_refused_as_what_it_is(tree: dict[str, Path]) -> None:
    root = AdapterRoot(tree["root"])
    assert refusal(root, "qv4\0") == "must not hold a NUL character"
    too_long = "a/" * (MAX_PATH_BYTES // 2) + "b"
    assert refusal(root, too_long) == f"must be at most {MAX_PATH_BYTES} bytes, got {MAX_PATH_BYTES + 1}"


def test_a_start_up_adapter_is_shown_relative_to_the_root_as_named_else_by_its_directory_s_name(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    (tree["root"] / "latest").symlink_to("team/mlp8")
    (tmp_path / "elsewhere").symlink_to(tree["root"] / "qv4")
    root = AdapterRoot(tree["root"])
    assert root.shown(tree["root"] / "team" / "mlp8") == "team/mlp8"
    # By the name it was given, as LoadAdapter reports a caller's "latest", not by its target.
    assert root.shown(tree["root"] / "latest") == "latest"
    assert root.shown(tmp_path / "elsewhere") == "qv4"  # named outside, inside once resolved
    # Outside the root, or with no root at all: never the server's own path, which every caller sees.
    assert root.shown(tree["outside"] / "secret") == "secret"
    assert start_up_shown(tree["outside"] / "secret") == "secret"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and searches every directory")
def test_a_directory_the_server_cannot_read_or_search_gets_the_one_refusal(tree: dict[str, Path]) -> None:
    root = AdapterRoot(tree["root"])
    said = set()
    for mode in (0o000, 0o300, 0o500 & ~0o100):  # nothing; no read; no search
        (tree["root"] / "qv4").chmod(mode)
        try:
            said.add(refusal(root, "qv4"))
        finally:
            (tree["root"] / "qv4").chmod(0o700)
    assert said == {refusal(root, "missing").replace("'missing'", "'qv4'")}


@pytest.mark.parametrize("step", ["open", "search"])
def test_a_directory_the_kernel_will_not_let_the_server_read_or_search_gets_the_one_refusal(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    # What the kernel answers a server that may not read (open) or search (stat a name in) the directory:
    # EACCES, said here, as the test above needs a server that is not root and this one may run as root.
    qv4 = os.stat(tree["root"] / "qv4").st_ino
    os_open, os_stat = os.open, os.stat

    def opening(path: str, flags: int, *args: object, dir_fd: int | None = None, **kwargs: object) -> int:
        if step == "open" and path == "qv4" and dir_fd is not None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

    def searching(path: str, *args: object, dir_fd: int | None = None, **kwargs: object) -> os.stat_result:
        if step == "search" and dir_fd is not None and os.fstat(dir_fd).st_ino == qv4:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return os_stat(path, *args, dir_fd=dir_fd, **kwargs)

    root = AdapterRoot(tree["root"])
    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "stat", searching)
    assert refusal(root, "qv4") == refusal(root, "missing").replace("'missing'", "'qv4'")


def deep_tree(top: Path, depth: int, name: str = "a", links: dict[int, str] | None = None) -> str:
    """`depth` directories `name` one in another under `top`, made by descriptor (the path may be over
    PATH_MAX), with an adapter at the bottom and symlink `l` -> `links[level]` at each level given:
    their path below `top`. Not much deeper than 500: pytest removes its old temporary directories
    recursively, a Python frame a level."""
    links = links or {}
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(1, depth + 1):
        os.mkdir(name, dir_fd=fd)
        fd, parent = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(parent)
        if level in links:
            os.symlink(links[level], "l", dir_fd=fd)
    for file_name, content in ((CONFIG_FILE, b"{}"), (WEIGHTS_FILE, b"")):
        file = os.open(file_name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(file, content)
        os.close(file)
    os.close(fd)
    return "/".join([name] * depth)


def test_a_deep_tree_is_walked_holding_a_few_descriptors_whatever_its_depth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One descriptor a level (what '..' climbed back through) held 2,007 for a 2,000-deep directory,
    # and every other open in the server failed with EMFILE (soft limit 1,024) while one find ran.
    root = tmp_path / "root"
    root.mkdir()
    deep = deep_tree(root, 300)
    (root / "up").symlink_to(deep + "/../../" + "/".join(["a"] * 2))  # '..' climbs, then goes down again
    # Counted: this process's descriptors open on something inside the root, so that other threads'
    # and the collector's opens and closes (the whole suite runs in this process) count for nothing.
    inside = str(root.resolve())

    def num_inside() -> int:
        count = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:  # closed meanwhile, or listdir's own
                continue
            count += target == inside or target.startswith(inside + "/")
        return count

    num_open = [num_inside()]
    os_open = os.open

    def counting_open(*args: object, **kwargs: object) -> int:
        fd = os_open(*args, **kwargs)  # type: ignore[arg-type]
        num_open.append(num_inside())
        return fd

    adapter_root = AdapterRoot(root)
    before = num_inside()  # the root's own, held while adapter_root lives
    monkeypatch.setattr(os, "open", counting_open)
    assert adapter_root.find(deep).found.directory == ("a",) * 300
    assert adapter_root.find("up").found.directory == ("a",) * 300
    monkeypatch.undo()
    assert max(num_open) <= before + 3  # the walk's directory, its next, a file opened in it
    assert num_inside() == before


def test_a_path_whose_symlinks_walk_more_than_twice_the_longest_path_is_refused_fast(tmp_path: Path) -> None:
    # 40 absolute symlinks each naming the bottom of a 2,000-deep tree walked ~80,000 components (0.5 s a
    # walk, 3 walks a find). A walk takes at most 4,096: 9 re-walks of 500 are refused, 2 still load.
    root = tmp_path / "root"
    root.mkdir()
    deep = deep_tree(root, 500)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (root / deep / name).unlink()
    for i in range(9):  # s{i} -> the bottom of the tree again, by its absolute path, then s{i + 1}
        (root / deep / f"s{i}").symlink_to(f"{root}/{deep}/s{i + 1}")
    adapter_dir(root / deep / "s9")
    adapter_root = AdapterRoot(root)
    assert adapter_root.find(f"{deep}/s7").found.directory == (*(["a"] * 500), "s9")
    start = time.thread_time()  # CPU time: a loaded host stretches the wall clock, not the work
    assert refusal(adapter_root, f"{deep}/s0").startswith("must name an adapter directory inside")
    assert time.thread_time() - start < 0.5


def test_a_resolved_path_over_path_max_below_the_root_is_refused(tmp_path: Path) -> None:
    # No kernel path names it, and the read refused it anyway (read_adapter's 4,096 bytes): a short path
    # whose symlinks lead 21 levels of 200 bytes down (4,220 bytes) is refused by find.
    root = tmp_path / "root"
    root.mkdir()
    name = "d" * 199
    deep_tree(root, 21, name, links={10: "/".join([name] * 11)})
    (root / "short").symlink_to("/".join([name] * 10) + "/l")
    assert refusal(AdapterRoot(root), "short").endswith("got 'short'")


def test_a_directory_moved_out_of_the_root_while_walked_is_not_climbed_out_of(
    tree: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # '..' reopens the parent of the directory the walk is in: one moved out of the root meanwhile has
    # a parent outside, which is not the directory the walk came through, so it is refused.
    root_dir = tree["root"]
    (root_dir / "x" / "y" / "z").mkdir(parents=True)
    (root_dir / "x" / "y" / "z" / "up").symlink_to("../../w")  # x/w, were y not moved
    adapter_dir(root_dir / "x" / "w")
    adapter_dir(tmp_path / "w")  # where y's '..' leads once y is moved to tmp_path
    os_readlink = os.readlink

    def moving_readlink(path: str, *, dir_fd: int | None = None) -> str:
        if path == "up":
            (root_dir / "x" / "y").rename(tmp_path / "y")
        return os_readlink(path, dir_fd=dir_fd)

    adapter_root = AdapterRoot(root_dir)
    assert adapter_root.find("x/y/z/up").found.directory == ("x", "w")
    monkeypatch.setattr(os, "readlink", moving_readlink)
    assert refusal(adapter_root, "x/y/z/up").endswith("got 'x/y/z/up'")


def test_a_root_removed_after_start_is_said_to_be_gone_naming_the_flag_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Every load got the one refusal of a caller's path, and nothing told the operator why.
    root_dir = tmp_path / "root"
    root_dir.mkdir()
    adapter_root = AdapterRoot(root_dir)
    root_dir.rmdir()
    for path in ("qv4", "team/mlp8"):
        with pytest.raises(FailedPrecondition) as refused:
            adapter_root.find(path)
        assert str(refused.value) == (
            "path: the server's --lora-root was removed after it started: it loads no adapter until restarted"
        )
    assert [r.getMessage() for r in caplog.records] == [
        f"--lora-root {root_dir} was removed after start: LoadAdapter refuses every path until a restart"
    ]


def test_a_root_renamed_after_start_is_still_served_where_it_now_lies(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    adapter_root = AdapterRoot(tree["root"])
    tree["root"].rename(tmp_path / "renamed")
    assert adapter_root.find("qv4").found.directory == ("qv4",)
