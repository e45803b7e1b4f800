"""The project's exception types. Every error a user can cause is one of these, with a precise message.

The CLI turns them into one-line messages and exit codes; nothing below the CLI prints or exits.
"""


class TrajectoryReplayError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidKeyError(TrajectoryReplayError, ValueError):
    """A storage key, digest, bundle id or payload name is malformed."""


class IntegrityError(TrajectoryReplayError):
    """Stored bytes do not match the digest that names them."""


class ValueTooLargeError(IntegrityError):
    """A stored value is larger than the bound its reader allows for what is stored there; refused unread."""


class NotFoundError(TrajectoryReplayError, KeyError):
    """A key, object, blob or bundle does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BackendError(TrajectoryReplayError):
    """A storage backend cannot be opened or cannot give a guarantee that is required."""


class BundleError(TrajectoryReplayError):
    """A bundle is invalid, incomplete, or cannot be written as asked."""


class IncompleteBundleError(BundleError):
    """A bundle whose final COMPLETE is missing (ranks or a whole commit not landed yet)."""


class SelectionError(TrajectoryReplayError):
    """A replay selection does not match the bundle (fails closed), or a path resolves to no bundle or to several."""


class NoSuchTargetError(NotFoundError, SelectionError):
    """What the command line points at is not there, or is not a bundle or store root."""


class NoMatchingBundleError(SelectionError):
    """A place holding bundles holds none that the --step/--critic/--rollout filter designates."""


class UnsupportedError(TrajectoryReplayError):
    """An algorithm or topology replay does not support."""


class UsageError(TrajectoryReplayError):
    """A malformed command line (exit code 2)."""


class StorageUnavailableError(BackendError):
    """The store cannot be reached or refuses us: endpoint down or silent, DNS, credentials, permissions, unknown
    bucket.

    The message is one line naming the URL and what to check; the CLI reports it with status `io`.
    """
