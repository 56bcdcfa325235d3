"""The GraphQL schema of CopilotKit runtime 1.10.6, type for type.

The SDL below is the protocol's contract: every type, field, argument, nullability, enum
value and description equals what the 1.10.6 runtime serves (the test suite compares the
printed, sorted schema with the one recorded from that runtime). `@defer` and `@stream` are
added as that runtime's GraphQL server adds them, and `@oneOf`, which it does not know, is
left out so introspection matches too.
"""

from __future__ import annotations

from functools import cache

from graphql import (
    GraphQLDeferDirective,
    GraphQLDeprecatedDirective,
    GraphQLIncludeDirective,
    GraphQLSchema,
    GraphQLSkipDirective,
    GraphQLSpecifiedByDirective,
    GraphQLStreamDirective,
    build_schema,
)

from copilot_runtime.protocols.graphql.scalars import install_scalars

__all__ = ["SDL", "copilot_schema"]

_ECMA_404 = "http://www.ecma-international.org/publications/files/ECMA-ST/ECMA-404.pdf"
_DATE_TIME = (
    "A date-time string at UTC, such as 2007-12-03T10:15:30Z, compliant with the `date-time` "
    "format outlined in section 5.6 of the RFC 3339 profile of the ISO 8601 standard for "
    "representation of dates and times using the Gregorian calendar.This scalar is "
    "serialized to a string in ISO 8601 format and parsed from a string in ISO 8601 format.")
_DEPRECATED = '@deprecated(reason: "This field will be removed in a future version")'

SDL = f'''
schema {{
  query: Query
  mutation: Mutation
}}

type Query {{
  availableAgents: AgentsResponse!
  hello: String!
  loadAgentState(data: LoadAgentStateInput!): LoadAgentStateResponse!
}}

type Mutation {{
  generateCopilotResponse(
    data: GenerateCopilotResponseInput!
    properties: JSONObject
  ): CopilotResponse!
}}

"""
{_DATE_TIME}
"""
scalar DateTimeISO

"""
The `JSON` scalar type represents JSON values as specified by [ECMA-404]({_ECMA_404}).
"""
scalar JSON @specifiedBy(url: "{_ECMA_404}")

"""
The `JSONObject` scalar type represents JSON objects as specified by [ECMA-404]({_ECMA_404}).
"""
scalar JSONObject @specifiedBy(url: "{_ECMA_404}")

"""The availability of the frontend action"""
enum ActionInputAvailability {{
  disabled
  enabled
  remote
}}

"""The type of Copilot request"""
enum CopilotRequestType {{
  Chat
  Suggestion
  Task
  TextareaCompletion
  TextareaPopover
}}

enum FailedResponseStatusReason {{
  GUARDRAILS_VALIDATION_FAILED
  MESSAGE_STREAM_INTERRUPTED
  UNKNOWN_ERROR
}}

"""The role of the message"""
enum MessageRole {{
  assistant
  developer
  system
  tool
  user
}}

enum MessageStatusCode {{
  Failed
  Pending
  Success
}}

"""Meta event types"""
enum MetaEventName {{
  CopilotKitLangGraphInterruptEvent
  LangGraphInterruptEvent
}}

enum ResponseStatusCode {{
  Failed
  Pending
  Success
}}

# ---- inputs -------------------------------------------------------------------------

input GenerateCopilotResponseInput {{
  agentSession: AgentSessionInput
  agentState: AgentStateInput
  agentStates: [AgentStateInput!]
  cloud: CloudInput
  context: [CopilotContextInput!]
  extensions: ExtensionsInput
  forwardedParameters: ForwardedParametersInput
  frontend: FrontendInput!
  messages: [MessageInput!]!
  metaEvents: [MetaEventInput!]
  metadata: GenerateCopilotResponseMetadataInput!
  runId: String
  threadId: String
}}

input GenerateCopilotResponseMetadataInput {{
  requestType: CopilotRequestType
}}

input MessageInput {{
  actionExecutionMessage: ActionExecutionMessageInput
  agentStateMessage: AgentStateMessageInput
  createdAt: DateTimeISO!
  id: String!
  imageMessage: ImageMessageInput
  resultMessage: ResultMessageInput
  textMessage: TextMessageInput
}}

input TextMessageInput {{
  content: String!
  parentMessageId: String
  role: MessageRole!
}}

input ActionExecutionMessageInput {{
  arguments: String!
  name: String!
  parentMessageId: String
  scope: String {_DEPRECATED}
}}

input ResultMessageInput {{
  actionExecutionId: String!
  actionName: String!
  parentMessageId: String
  result: String!
}}

input AgentStateMessageInput {{
  active: Boolean!
  agentName: String!
  nodeName: String!
  role: MessageRole!
  runId: String!
  running: Boolean!
  state: String!
  threadId: String!
}}

input ImageMessageInput {{
  bytes: String!
  format: String!
  parentMessageId: String
  role: MessageRole!
}}

input FrontendInput {{
  actions: [ActionInput!]!
  toDeprecate_fullContext: String
  url: String
}}

input ActionInput {{
  available: ActionInputAvailability
  description: String!
  jsonSchema: String!
  name: String!
}}

input CloudInput {{
  guardrails: GuardrailsInput
}}

input GuardrailsInput {{
  inputValidationRules: GuardrailsRuleInput!
}}

input GuardrailsRuleInput {{
  allowList: [String!] = []
  denyList: [String!] = []
}}

input ForwardedParametersInput {{
  maxTokens: Float
  model: String
  stop: [String!]
  temperature: Float
  toolChoice: String
  toolChoiceFunctionName: String
}}

input AgentSessionInput {{
  agentName: String!
  nodeName: String
  threadId: String
}}

input AgentStateInput {{
  agentName: String!
  config: String
  state: String!
}}

input ExtensionsInput {{
  openaiAssistantAPI: OpenAIApiAssistantAPIInput
}}

input OpenAIApiAssistantAPIInput {{
  runId: String
  threadId: String
}}

input MetaEventInput {{
  messages: [MessageInput!]
  name: MetaEventName!
  response: String
  value: String!
}}

input CopilotContextInput {{
  description: String!
  value: String!
}}

input LoadAgentStateInput {{
  agentName: String!
  threadId: String!
}}

# ---- the response of generateCopilotResponse -------------------------------------------

type CopilotResponse {{
  extensions: ExtensionsResponse
  messages: [BaseMessageOutput!]!
  metaEvents: [BaseMetaEvent!]
  runId: String
  status: ResponseStatus!
  threadId: String!
}}

type ExtensionsResponse {{
  openaiAssistantAPI: OpenAIApiAssistantAPIResponse
}}

type OpenAIApiAssistantAPIResponse {{
  runId: String
  threadId: String
}}

interface BaseResponseStatus {{
  code: ResponseStatusCode!
}}

union ResponseStatus = FailedResponseStatus | PendingResponseStatus | SuccessResponseStatus

type SuccessResponseStatus implements BaseResponseStatus {{
  code: ResponseStatusCode!
}}

type PendingResponseStatus implements BaseResponseStatus {{
  code: ResponseStatusCode!
}}

type FailedResponseStatus implements BaseResponseStatus {{
  code: ResponseStatusCode!
  details: JSON
  reason: FailedResponseStatusReason!
}}

interface BaseMessageOutput {{
  createdAt: DateTimeISO!
  id: String!
  status: MessageStatus!
}}

union MessageStatus = FailedMessageStatus | PendingMessageStatus | SuccessMessageStatus

type SuccessMessageStatus {{
  code: MessageStatusCode!
}}

type PendingMessageStatus {{
  code: MessageStatusCode!
}}

type FailedMessageStatus {{
  code: MessageStatusCode!
  reason: String!
}}

type TextMessageOutput implements BaseMessageOutput {{
  content: [String!]!
  createdAt: DateTimeISO!
  id: String!
  parentMessageId: String
  role: MessageRole!
  status: MessageStatus!
}}

type ActionExecutionMessageOutput implements BaseMessageOutput {{
  arguments: [String!]!
  createdAt: DateTimeISO!
  id: String!
  name: String!
  parentMessageId: String
  scope: String {_DEPRECATED}
  status: MessageStatus!
}}

type ResultMessageOutput implements BaseMessageOutput {{
  actionExecutionId: String!
  actionName: String!
  createdAt: DateTimeISO!
  id: String!
  result: String!
  status: MessageStatus!
}}

type AgentStateMessageOutput implements BaseMessageOutput {{
  active: Boolean!
  agentName: String!
  createdAt: DateTimeISO!
  id: String!
  nodeName: String!
  role: MessageRole!
  runId: String!
  running: Boolean!
  state: String!
  status: MessageStatus!
  threadId: String!
}}

type ImageMessageOutput implements BaseMessageOutput {{
  bytes: String!
  createdAt: DateTimeISO!
  format: String!
  id: String!
  parentMessageId: String
  role: MessageRole!
  status: MessageStatus!
}}

interface BaseMetaEvent {{
  name: MetaEventName!
  type: String!
}}

type LangGraphInterruptEvent implements BaseMetaEvent {{
  name: MetaEventName!
  response: String
  type: String!
  value: String!
}}

type CopilotKitLangGraphInterruptEvent implements BaseMetaEvent {{
  data: CopilotKitLangGraphInterruptEventData!
  name: MetaEventName!
  response: String
  type: String!
}}

type CopilotKitLangGraphInterruptEventData {{
  messages: [BaseMessageOutput!]!
  value: String!
}}

# ---- queries -----------------------------------------------------------------------------

type AgentsResponse {{
  agents: [Agent!]!
}}

type Agent {{
  description: String!
  id: String!
  name: String!
}}

type LoadAgentStateResponse {{
  messages: String!
  state: String!
  threadExists: Boolean!
  threadId: String!
}}
'''


@cache
def copilot_schema() -> GraphQLSchema:
    """The schema, built once per process (building and validating it takes a few ms)."""
    built = build_schema(SDL)
    kwargs = built.to_kwargs()
    kwargs["directives"] = (GraphQLIncludeDirective, GraphQLSkipDirective,
                            GraphQLDeprecatedDirective, GraphQLSpecifiedByDirective,
                            GraphQLDeferDirective, GraphQLStreamDirective)
    schema = GraphQLSchema(**kwargs)
    install_scalars(schema)
    return schema
