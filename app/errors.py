"""Every error the service raises on purpose.

    AppError                     base; `message` defaults to the class docstring
    ├── NotFound                 404: no such job, file or model visible to the caller
    │   ├── JobNotFound
    │   └── FileNotFound
    ├── Gone                     410: the job's files were deleted by retention
    ├── Conflict                 409: the job is in a state that does not allow this
    ├── InvalidRequest           422: bad model, params or priority (names the field)
    │   ├── UnknownModel
    │   └── InvalidParams
    ├── UnsupportedMedia         415: the upload is not an accepted image
    ├── PayloadTooLarge          413: the upload is over the configured limit
    ├── QueueFull                429: too many queued jobs (carries `retry_after_s`)
    ├── KeyRevoked               401: the request's API key was revoked while it was served
    ├── Forbidden                403: a download link that is tampered with or expired
    │   └── LinkExpired          a well signed link past its expiry
    ├── Unavailable              503: the database cannot be reached right now
    ├── LeaseLost                a worker's write lost to a newer attempt (fencing)
    ├── RegistryError            the model registry file is broken (names file, model, field)
    ├── ConfigError              a setting cannot work (names the setting)
    └── StorageError             a file could not be written or read under storage/

Routes never build HTTP errors themselves: `api.main` maps `status_code` to the response.
"""

from __future__ import annotations


class AppError(Exception):
    """Something went wrong."""

    status_code: int = 500

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "").strip()
        super().__init__(self.message)


class NotFound(AppError):
    """Not found."""

    status_code = 404


class JobNotFound(NotFound):
    """No job with this id."""


class FileNotFound(NotFound):
    """The job has no file with this name."""


class Gone(AppError):
    """The job's files were deleted by retention."""

    status_code = 410


class Conflict(AppError):
    """The job is in a state that does not allow this."""

    status_code = 409


class InvalidRequest(AppError):
    """The request is not valid."""

    status_code = 422

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownModel(InvalidRequest):
    """No model with this name is registered."""


class InvalidParams(InvalidRequest):
    """The model parameters are not valid."""


class UnsupportedMedia(AppError):
    """The upload is not a PNG, JPEG or WebP image."""

    status_code = 415


class PayloadTooLarge(AppError):
    """The upload is larger than the configured limit."""

    status_code = 413


class QueueFull(AppError):
    """The queue is full; try again later."""

    status_code = 429

    def __init__(self, message: str | None = None, *, retry_after_s: int = 30) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class KeyRevoked(AppError):
    """The API key a request came with was revoked while it was being served."""

    status_code = 401


class Forbidden(AppError):
    """This link is not valid (tampered with or expired)."""

    status_code = 403


class LinkExpired(Forbidden):
    """This download link has expired; fetch the job again for a fresh one."""


class Unavailable(AppError):
    """The database cannot be reached right now; try again shortly."""

    status_code = 503

    def __init__(self, message: str | None = None, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LeaseLost(AppError):
    """This attempt no longer owns the job; a newer attempt or a cancel won."""


class RegistryError(AppError):
    """The model registry is not valid."""


class ConfigError(AppError):
    """A setting is not valid."""


class StorageError(AppError):
    """A file under storage/ could not be written or read."""
