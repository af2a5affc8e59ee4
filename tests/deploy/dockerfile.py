"""deploy/Dockerfile and its dockerignore read as the build reads them: targets, COPY lines, what the context
leaves out (shared by the Dockerfile and compose tests)."""
from __future__ import annotations

import pathlib
import re

from tests.deploy.shared import DEPLOY


def dockerfile_targets() -> dict[str, str]:
    """deploy/Dockerfile's build targets: name -> the instructions of that target."""
    parts = re.split(r"^FROM \S+ AS (\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def copies_of(target: str) -> list[tuple[str, str, str]]:
    """The COPY instructions of a target, in order: (flags, source in the context, destination)."""
    return re.findall(r"^COPY((?: --\S+)*) (\S+) (\S+)$", dockerfile_targets()[target], flags=re.M)


def stage_copy_of(model_dir: pathlib.Path) -> tuple[int, str, str]:
    """The `stage` COPY that puts the repository's `model_dir` at the same path under WORKDIR /app, directly or
    through another target (`COPY --from=`): (its index among the stage's COPYs, the context source it comes from,
    the target that copied it from the context)."""
    assert re.search(r"^WORKDIR /app$", dockerfile_targets()["base"], flags=re.M)
    inside = pathlib.PurePosixPath(model_dir.as_posix())
    wanted = pathlib.PurePosixPath("/app") / inside

    def place(dest: str, workdir: str) -> pathlib.PurePosixPath:
        return pathlib.PurePosixPath(workdir) / dest.rstrip("/")  # absolute destinations stay absolute

    for index, (flags, source, dest) in enumerate(copies_of("stage")):
        origin = re.search(r"--from=(\S+)", flags)
        # where the source's files come from: the context, or the context via a COPY in the named target
        candidates = [(source, "stage")] if origin is None else [
            (src, origin.group(1)) for fl, src, dst in copies_of(origin.group(1)) if "--from" not in fl
            if place(dst, "/") == pathlib.PurePosixPath(source.rstrip("/"))]
        for context_source, copied_in in candidates:
            source_path = pathlib.PurePosixPath(context_source.rstrip("/"))
            if (inside == source_path or source_path in inside.parents) and (
                    place(dest, "/app") / inside.relative_to(source_path) == wanted):
                return index, context_source, copied_in
    raise AssertionError(f"the stage target copies no {model_dir} to {wanted}")


def ignore_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regular expression over context-relative paths (Go filepath.Match plus `**`)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def context_excludes(path: str) -> bool:
    """Whether deploy/Dockerfile.dockerignore leaves `path` (relative to the repository root) out of the build
    context: the last pattern matching it or a directory above it decides, a `!` pattern putting it back."""
    rel = pathlib.PurePosixPath(path.rstrip("/"))
    candidates = [rel.as_posix(), *(p.as_posix() for p in rel.parents if p.as_posix() != ".")]
    excluded = False
    for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = ignore_pattern(line.lstrip("!").strip().strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded
