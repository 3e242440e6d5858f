from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATUS_UNSPECIFIED: _ClassVar[ServingStatus]
    SERVING_STATUS_SERVING: _ClassVar[ServingStatus]
    SERVING_STATUS_SHUTTING_DOWN: _ClassVar[ServingStatus]
    SERVING_STATUS_ENGINE_FAILED: _ClassVar[ServingStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
SERVING_STATUS_UNSPECIFIED: ServingStatus
SERVING_STATUS_SERVING: ServingStatus
SERVING_STATUS_SHUTTING_DOWN: ServingStatus
SERVING_STATUS_ENGINE_FAILED: ServingStatus

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "history_tokens", "computed_tokens", "resident_pages", "resident_kv_bytes", "reused_tokens", "last_prefill_tokens", "generating", "created_at", "idle_s", "ttl_s", "kv_policy", "kv_sink_tokens", "kv_window_tokens", "kv_bytes_per_token", "tier_bytes_per_token", "host_tier_bytes", "disk_tier_bytes", "global_kv_bytes", "unsaved_changes", "last_saved_at", "save_failures", "resident", "forgotten_tokens", "invariant_violations")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    KV_SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNSAVED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    LAST_SAVED_AT_FIELD_NUMBER: _ClassVar[int]
    SAVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INVARIANT_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history_tokens: int
    computed_tokens: int
    resident_pages: int
    resident_kv_bytes: int
    reused_tokens: int
    last_prefill_tokens: int
    generating: bool
    created_at: float
    idle_s: float
    ttl_s: float
    kv_policy: str
    kv_sink_tokens: int
    kv_window_tokens: int
    kv_bytes_per_token: float
    tier_bytes_per_token: float
    host_tier_bytes: int
    disk_tier_bytes: int
    global_kv_bytes: int
    unsaved_changes: bool
    last_saved_at: float
    save_failures: int
    resident: bool
    forgotten_tokens: int
    invariant_violations: int
    def __init__(self, session_id: _Optional[str] = ..., history_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., resident_pages: _Optional[int] = ..., resident_kv_bytes: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., last_prefill_tokens: _Optional[int] = ..., generating: _Optional[bool] = ..., created_at: _Optional[float] = ..., idle_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., kv_policy: _Optional[str] = ..., kv_sink_tokens: _Optional[int] = ..., kv_window_tokens: _Optional[int] = ..., kv_bytes_per_token: _Optional[float] = ..., tier_bytes_per_token: _Optional[float] = ..., host_tier_bytes: _Optional[int] = ..., disk_tier_bytes: _Optional[int] = ..., global_kv_bytes: _Optional[int] = ..., unsaved_changes: _Optional[bool] = ..., last_saved_at: _Optional[float] = ..., save_failures: _Optional[int] = ..., resident: _Optional[bool] = ..., forgotten_tokens: _Optional[int] = ..., invariant_violations: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "reused_tokens", "prefilled_tokens", "generated_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("token_ids", "ttl_s", "kv_policy", "kv_sink_tokens", "kv_window_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    KV_SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    kv_policy: str
    kv_sink_tokens: int
    kv_window_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ..., kv_policy: _Optional[str] = ..., kv_sink_tokens: _Optional[int] = ..., kv_window_tokens: _Optional[int] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class AppendTokensRequest(_message.Message):
    __slots__ = ("session_id", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendTokensResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "json_schema", "regex", "grammar", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    json_schema: str
    regex: str
    grammar: str
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    def __init__(self, session_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("tokens", "finish")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    finish: Finish
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "usage", "stop_string")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    stop_string: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stop_string: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSessionInfoRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionInfoResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "at")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    at: int
    def __init__(self, session_id: _Optional[str] = ..., at: _Optional[int] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "model", "vocab_size", "max_model_len", "sessions", "kv_pages_used", "kv_pages_cached", "kv_pages_free")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    status: ServingStatus
    model: str
    vocab_size: int
    max_model_len: int
    sessions: int
    kv_pages_used: int
    kv_pages_cached: int
    kv_pages_free: int
    def __init__(self, status: _Optional[_Union[ServingStatus, str]] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., sessions: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., kv_pages_free: _Optional[int] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("snapshot_id", "session_id", "history_tokens", "kv_tokens", "pages", "created_at")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    session_id: str
    history_tokens: int
    kv_tokens: int
    pages: int
    created_at: float
    def __init__(self, snapshot_id: _Optional[str] = ..., session_id: _Optional[str] = ..., history_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., pages: _Optional[int] = ..., created_at: _Optional[float] = ...) -> None: ...

class SnapshotSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SnapshotSessionResponse(_message.Message):
    __slots__ = ("snapshot",)
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    snapshot: SnapshotInfo
    def __init__(self, snapshot: _Optional[_Union[SnapshotInfo, _Mapping]] = ...) -> None: ...

class RestoreSessionRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class RestoreSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class DeleteSnapshotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
