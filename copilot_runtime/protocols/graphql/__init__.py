"""The GraphQL protocol of CopilotKit 1.0 to 1.10 (`@copilotkit/runtime-client-gql`)."""

from copilot_runtime.protocols.graphql.handlers import GraphQLProtocol

__all__ = ["GraphQLProtocol"]
