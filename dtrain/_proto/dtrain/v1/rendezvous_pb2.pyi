from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Member(_message.Message):
    __slots__ = ("site_id", "address", "rank_addresses")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    address: str
    rank_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, site_id: _Optional[str] = ..., address: _Optional[str] = ..., rank_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class RoundPlan(_message.Message):
    __slots__ = ("round", "members", "reduce_timeout_s", "broadcast_timeout_s", "datagram_key", "left_out", "deadline_reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REDUCE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DATAGRAM_KEY_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    reduce_timeout_s: float
    broadcast_timeout_s: float
    datagram_key: bytes
    left_out: _containers.RepeatedScalarFieldContainer[str]
    deadline_reason: str
    def __init__(self, round: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., reduce_timeout_s: _Optional[float] = ..., broadcast_timeout_s: _Optional[float] = ..., datagram_key: _Optional[bytes] = ..., left_out: _Optional[_Iterable[str]] = ..., deadline_reason: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("site_id", "address", "rank_addresses")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    address: str
    rank_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, site_id: _Optional[str] = ..., address: _Optional[str] = ..., rank_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("next_round", "members", "heartbeat_interval_s", "needs_state")
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NEEDS_STATE_FIELD_NUMBER: _ClassVar[int]
    next_round: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    heartbeat_interval_s: float
    needs_state: bool
    def __init__(self, next_round: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ..., needs_state: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("site_id", "inner_step", "last_loss", "round_reports", "unreachable", "rounds_done", "catch_up_eta_s")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    ROUND_REPORTS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_DONE_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_ETA_S_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    inner_step: int
    last_loss: float
    round_reports: _containers.RepeatedScalarFieldContainer[str]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    rounds_done: int
    catch_up_eta_s: float
    def __init__(self, site_id: _Optional[str] = ..., inner_step: _Optional[int] = ..., last_loss: _Optional[float] = ..., round_reports: _Optional[_Iterable[str]] = ..., unreachable: _Optional[_Iterable[str]] = ..., rounds_done: _Optional[int] = ..., catch_up_eta_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "resync_required", "next_round", "reason", "dead", "behind")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEAD_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    known: bool
    resync_required: bool
    next_round: int
    reason: str
    dead: _containers.RepeatedScalarFieldContainer[str]
    behind: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, known: _Optional[bool] = ..., resync_required: _Optional[bool] = ..., next_round: _Optional[int] = ..., reason: _Optional[str] = ..., dead: _Optional[_Iterable[str]] = ..., behind: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ("site_id", "round", "wait_ms")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    round: int
    wait_ms: int
    def __init__(self, site_id: _Optional[str] = ..., round: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class ReadyReply(_message.Message):
    __slots__ = ("status", "reason", "next_round", "plan", "plan_age_s", "held_s")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    status: str
    reason: str
    next_round: int
    plan: RoundPlan
    plan_age_s: float
    held_s: float
    def __init__(self, status: _Optional[str] = ..., reason: _Optional[str] = ..., next_round: _Optional[int] = ..., plan: _Optional[_Union[RoundPlan, _Mapping]] = ..., plan_age_s: _Optional[float] = ..., held_s: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("site_id",)
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    def __init__(self, site_id: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
