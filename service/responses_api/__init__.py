"""OpenAI's Responses API: POST /v1/responses and the stored responses (route.py says how)."""
