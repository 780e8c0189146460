"""The Python-level write diversion, for hosts that forbid user namespaces.

Runs in a rank whose writes are diverted where the overlay is refused: installed on its main thread
before the cell, its patched functions on whichever thread writes.

A copy-on-write view of the repository kept by Python itself: paths under the
repository are resolved through a private layer directory. A write goes to the layer
(appending or updating copies the repository's file up first); a delete leaves a
tombstone; reads, ``stat`` and ``listdir`` see the layer over the repository, so the
rank reads back what it wrote and the repository itself never changes.

Covered: ``open``/``io.open`` (so ``pathlib``, ``numpy.save``, ``shutil.copy*``, fsspec
and Lightning's checkpoint writer), ``os.open``, ``os.remove``/``unlink``/``rename``/
``replace``/``mkdir``/``makedirs``/``rmdir``/``chmod``/``stat``/``lstat``/``listdir``/
``scandir``-free existence checks, ``shutil.rmtree``/``move``, and ``torch.save`` (whose
C++ writer opens the file itself).

Paths are compared after ``os.path.abspath`` (not ``realpath``): a symbolic link from
outside into the repository is not followed.

This module is the patched functions and :func:`install`; the layer's bookkeeping (where a
path is read and written, copy-up, tombstones, the changes log) is writes/layer.py.

NOT covered (the header says which mode is in force; docs/guide/write-rule.md repeats this): any
process the rank starts (``!cmd``, ``subprocess``), C extensions other than torch.save
that open files themselves, file descriptors opened before the cell, ``os.link``/
``symlink``/``truncate(path)``/``utime``, and ``dir_fd=`` arguments.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import stat
from types import ModuleType
from typing import Any, Callable, Union

from taas_magic.writes.layer import Layer

Path = Union[str, "os.PathLike[str]"]  # what the patched functions accept for a path

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Diversion:
    """The patched functions: each sends a path under the repository through the rank's layer
    (writes/layer.py) and any other path, or a ``dir_fd=`` call, to the function it replaced."""

    def __init__(self, repository: str, layer: str):
        self.layer = Layer(repository, layer)
        self.real = {name: getattr(os, name) for name in (
            "open", "remove", "rename", "mkdir", "rmdir", "chmod", "stat", "lstat", "listdir")}
        self.real_open = builtins.open
        self.real_rmtree = shutil.rmtree

    def open(self, file: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if self.layer.relative(file) is None:
            return self.real_open(file, mode, *args, **kwargs)
        writes = any(flag in mode for flag in "wax+")
        copy_up = "a" in mode or "+" in mode and "w" not in mode
        target = self.layer.for_writing(file, copy_up=copy_up) if writes else self.layer.for_reading(file)
        return self.real_open(target, mode, *args, **kwargs)

    def os_open(self, path: Path, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if dir_fd is not None or self.layer.relative(path) is None:
            return self.real["open"](path, flags, mode, dir_fd=dir_fd)
        if flags & _WRITE_FLAGS:
            target = self.layer.for_writing(path, copy_up=not flags & os.O_TRUNC)
        else:
            target = self.layer.for_reading(path)
        return self.real["open"](target, flags, mode)

    def remove(self, path: Path, *, dir_fd: int | None = None) -> None:
        if dir_fd is not None or self.layer.relative(path) is None:
            return self.real["remove"](path, dir_fd=dir_fd)
        self.real["lstat"](self.layer.for_reading(path))  # FileNotFoundError as without taas
        self.layer.delete(path, is_dir=False)

    def rmdir(self, path: Path, *, dir_fd: int | None = None) -> None:
        if dir_fd is not None or self.layer.relative(path) is None:
            return self.real["rmdir"](path, dir_fd=dir_fd)
        if self.listdir(path):
            raise OSError(39, "Directory not empty", path)
        self.layer.delete(path, is_dir=True)

    def rmtree(self, path: Path, *args: Any, **kwargs: Any) -> None:
        if self.layer.relative(path) is None:
            return self.real_rmtree(path, *args, **kwargs)
        self.real["lstat"](self.layer.for_reading(path))
        self.layer.delete(path, is_dir=True)

    def rename(self, src: Path, dst: Path, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        layer = self.layer
        if src_dir_fd is not None or dst_dir_fd is not None or (layer.relative(src) is None and layer.relative(dst) is None):
            return self.real["rename"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        source = layer.for_reading(src)
        target = layer.for_writing(dst, copy_up=False)
        if os.path.isdir(target) and not os.path.isdir(source):
            raise IsADirectoryError(21, "Is a directory", dst)
        if layer.relative(src) is None:  # into the repository from outside: move it in
            return self.real["rename"](source, target)
        if os.path.isdir(source):
            if os.path.lexists(target):
                self.real_rmtree(target)
            shutil.copytree(source, target, symlinks=True)
        else:
            shutil.copy2(source, target)
        layer.delete(src, is_dir=os.path.isdir(source))

    def mkdir(self, path: Path, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if dir_fd is not None or self.layer.relative(path) is None:
            return self.real["mkdir"](path, mode, dir_fd=dir_fd)
        if os.path.lexists(self.layer.for_reading(path)):
            raise FileExistsError(17, "File exists", path)
        self.real["mkdir"](self.layer.for_writing(path, copy_up=False), mode)

    def chmod(self, path: Path, mode: int, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
        if dir_fd is not None or self.layer.relative(path) is None:
            return self.real["chmod"](path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        self.real["lstat"](self.layer.for_reading(path))
        self.real["chmod"](self.layer.for_writing(path, copy_up=True), mode, follow_symlinks=follow_symlinks)

    def stat(self, path: Path, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> os.stat_result:
        if dir_fd is None:
            path = self.layer.for_reading(path)
        return self.real["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

    def lstat(self, path: Path, *, dir_fd: int | None = None) -> os.stat_result:
        if dir_fd is None:
            path = self.layer.for_reading(path)
        return self.real["lstat"](path, dir_fd=dir_fd)

    def listdir(self, path: Path = ".") -> list[str]:
        relative = self.layer.relative(path)
        if relative is None:
            return self.real["listdir"](path)
        if not stat.S_ISDIR(self.real["stat"](self.layer.for_reading(path)).st_mode):  # FileNotFoundError as without taas
            raise NotADirectoryError(20, "Not a directory", path)
        return self.layer.names(relative, self.real["listdir"])

    def torch_save(self, real_save: Callable[..., None]) -> Callable[..., None]:
        def save(obj: object, f: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(f, (str, bytes, os.PathLike)):
                f = self.layer.for_writing(f, copy_up=False)
            return real_save(obj, f, *args, **kwargs)

        return save


def install(repository: str, layer: str) -> Diversion:
    """Divert this process's Python-level writes under ``repository`` into ``layer``."""
    from taas_magic.import_hooks import when_imported
    from taas_magic.writes import shared

    diversion = Diversion(repository, layer)
    shared.use_layer(repository, diversion.layer)
    patched: list[tuple[ModuleType, str, Callable[..., Any]]] = [
        (builtins, "open", diversion.open), (io, "open", diversion.open), (os, "open", diversion.os_open),
        (os, "remove", diversion.remove), (os, "unlink", diversion.remove),
        (os, "rename", diversion.rename), (os, "replace", diversion.rename),
        (os, "mkdir", diversion.mkdir), (os, "rmdir", diversion.rmdir), (os, "chmod", diversion.chmod),
        (os, "stat", diversion.stat), (os, "lstat", diversion.lstat), (os, "listdir", diversion.listdir),
        (shutil, "rmtree", diversion.rmtree),
    ]
    for module, name, function in patched:
        setattr(module, name, function)  # narrower signatures than the originals': replacing them is the point

    def patch_torch(torch_module: ModuleType) -> None:
        import torch.serialization as serialization

        save = diversion.torch_save(serialization.save)
        setattr(torch_module, "save", save)  # noqa: B010 - torch's stubs say it is not assignable; it is
        serialization.save = save

    when_imported("torch", patch_torch)
    return diversion
