from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExplainRequest(_message.Message):
    __slots__ = ("path", "body", "policy", "headers")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    path: str
    body: bytes
    policy: str
    headers: _containers.ScalarMap[str, str]
    def __init__(self, path: _Optional[str] = ..., body: _Optional[bytes] = ..., policy: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EndpointExplain(_message.Message):
    __slots__ = ("endpoint", "matched_blocks", "cached_tokens_est", "ttft_estimate_s", "score", "scores", "health", "in_flight_requests", "waiting", "kv_usage", "model")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_EST_FIELD_NUMBER: _ClassVar[int]
    TTFT_ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    matched_blocks: int
    cached_tokens_est: int
    ttft_estimate_s: float
    score: float
    scores: _containers.ScalarMap[str, float]
    health: str
    in_flight_requests: int
    waiting: float
    kv_usage: float
    model: LoadModel
    def __init__(self, endpoint: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., cached_tokens_est: _Optional[int] = ..., ttft_estimate_s: _Optional[float] = ..., score: _Optional[float] = ..., scores: _Optional[_Mapping[str, float]] = ..., health: _Optional[str] = ..., in_flight_requests: _Optional[int] = ..., waiting: _Optional[float] = ..., kv_usage: _Optional[float] = ..., model: _Optional[_Union[LoadModel, _Mapping]] = ...) -> None: ...

class LoadModel(_message.Message):
    __slots__ = ("prefill_tokens_per_s", "prefill_source", "step_base_s", "step_per_seq_s", "step_source", "uncached_tokens_per_request")
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_BASE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_PER_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    STEP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    prefill_tokens_per_s: float
    prefill_source: str
    step_base_s: float
    step_per_seq_s: float
    step_source: str
    uncached_tokens_per_request: float
    def __init__(self, prefill_tokens_per_s: _Optional[float] = ..., prefill_source: _Optional[str] = ..., step_base_s: _Optional[float] = ..., step_per_seq_s: _Optional[float] = ..., step_source: _Optional[str] = ..., uncached_tokens_per_request: _Optional[float] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("policy", "prompt_tokens_est", "blocks", "chosen", "endpoints")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_EST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    prompt_tokens_est: int
    blocks: int
    chosen: _containers.RepeatedScalarFieldContainer[str]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointExplain]
    def __init__(self, policy: _Optional[str] = ..., prompt_tokens_est: _Optional[int] = ..., blocks: _Optional[int] = ..., chosen: _Optional[_Iterable[str]] = ..., endpoints: _Optional[_Iterable[_Union[EndpointExplain, _Mapping]]] = ...) -> None: ...
