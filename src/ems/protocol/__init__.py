"""The ems wire protocol, sans-I/O: messages (``messages``) and frames (``framing``).

Nothing here touches a socket: :func:`encode` turns a message into bytes and
:class:`FrameDecoder` turns received bytes back into messages, so the daemon, the
client and the tests drive the same code. It imports nothing of ems but ``errors``.
"""

from ems.protocol import messages
from ems.protocol.framing import (
    HEADER,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameDecoder,
    encode,
    encode_wire,
    protocol_error,
)
from ems.protocol.messages import auth_mac

__all__ = [
    "HEADER",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "FrameDecoder",
    "auth_mac",
    "encode",
    "encode_wire",
    "messages",
    "protocol_error",
]
