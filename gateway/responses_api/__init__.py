"""OpenAI's Responses API, with the conversation kept in the pool as token ids.

Not to be confused with `gateway.responses`, which writes the bodies of chat and text
completions. `routes` serves the API, `schemas` checks requests, `prepare` turns one into
a job (continuing a stored conversation's exact tokens), `run` relays the job into a body
or events, `items` maps items to chat messages and the answer to output items, and
`state` keeps stored responses in Redis, per tenant.
"""
