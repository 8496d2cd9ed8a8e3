"""A process-wide choice of implementation, "auto" | "torch" | "triton", set from an
environment variable or in code. Newton-Schulz and the elementwise step each have one."""

from __future__ import annotations

import os

BACKENDS = ("auto", "torch", "triton")


class BackendSetting:
    def __init__(self, env_var: str) -> None:
        self.env_var = env_var
        self.value = self._checked(os.environ.get(env_var, "auto"), env_var)

    @staticmethod
    def _checked(backend: str, name: str) -> str:
        if backend not in BACKENDS:
            raise ValueError(f"{name} should be one of {BACKENDS} but is: {backend!r}")
        return backend

    def set(self, backend: str) -> str:
        """Set the backend; returns the previous one."""
        previous, self.value = self.value, self._checked(backend, "backend")
        return previous
