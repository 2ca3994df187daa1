"""Tool calls: `tools`/`tool_choice` requests, each model family's tool-call format (the
grammar that forces a call, the parser that reads calls back), and their streaming."""
