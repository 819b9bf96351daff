"""The HTTP server (`jackfield serve`): an OpenAI-compatible API over one AsyncEngine."""
