from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContributionChunk(_message.Message):
    __slots__ = ("round", "bucket", "chunk", "offset", "numel", "codec", "sender", "payload", "tokens")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    round: int
    bucket: int
    chunk: int
    offset: int
    numel: int
    codec: str
    sender: str
    payload: bytes
    tokens: int
    def __init__(self, round: _Optional[int] = ..., bucket: _Optional[int] = ..., chunk: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., codec: _Optional[str] = ..., sender: _Optional[str] = ..., payload: _Optional[bytes] = ..., tokens: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("num_accepted", "payload_bytes")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    payload_bytes: int
    def __init__(self, num_accepted: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class PullMeanRequest(_message.Message):
    __slots__ = ("round", "bucket", "requester", "timeout_ms", "have_checksum")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HAVE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    round: int
    bucket: int
    requester: str
    timeout_ms: int
    have_checksum: str
    def __init__(self, round: _Optional[int] = ..., bucket: _Optional[int] = ..., requester: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., have_checksum: _Optional[str] = ...) -> None: ...

class MeanPart(_message.Message):
    __slots__ = ("header", "chunk", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: MeanHeader
    chunk: MeanChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[MeanHeader, _Mapping]] = ..., chunk: _Optional[_Union[MeanChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class MeanHeader(_message.Message):
    __slots__ = ("round", "bucket", "owner", "checksum_before", "checksum_after", "num_chunks")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_AFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    round: int
    bucket: int
    owner: str
    checksum_before: str
    checksum_after: str
    num_chunks: int
    def __init__(self, round: _Optional[int] = ..., bucket: _Optional[int] = ..., owner: _Optional[str] = ..., checksum_before: _Optional[str] = ..., checksum_after: _Optional[str] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class MeanChunkHeader(_message.Message):
    __slots__ = ("chunk", "offset", "numel", "codec", "senders", "payload_bytes")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SENDERS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    offset: int
    numel: int
    codec: str
    senders: _containers.RepeatedScalarFieldContainer[str]
    payload_bytes: int
    def __init__(self, chunk: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., codec: _Optional[str] = ..., senders: _Optional[_Iterable[str]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class PullStateRequest(_message.Message):
    __slots__ = ("bucket", "requester")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    requester: str
    def __init__(self, bucket: _Optional[int] = ..., requester: _Optional[str] = ...) -> None: ...

class StatePart(_message.Message):
    __slots__ = ("header", "theta", "optimizer_state")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    THETA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    theta: bytes
    optimizer_state: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., theta: _Optional[bytes] = ..., optimizer_state: _Optional[bytes] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("bucket", "rounds_applied", "checksum", "theta_bytes", "optimizer_state_bytes", "extra_json")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    THETA_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    rounds_applied: int
    checksum: str
    theta_bytes: int
    optimizer_state_bytes: int
    extra_json: str
    def __init__(self, bucket: _Optional[int] = ..., rounds_applied: _Optional[int] = ..., checksum: _Optional[str] = ..., theta_bytes: _Optional[int] = ..., optimizer_state_bytes: _Optional[int] = ..., extra_json: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("bytes", "part_bytes", "requester")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    part_bytes: int
    requester: str
    def __init__(self, bytes: _Optional[int] = ..., part_bytes: _Optional[int] = ..., requester: _Optional[str] = ...) -> None: ...

class ProbePart(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
