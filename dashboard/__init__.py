"""`python deploy.py dashboard`: a local web page of the stacks, their runs, a run's live log and plots, cost
and timelines (app.py: Starlette on uvicorn; sources.py: what it reads; shape.py: pure shaping)."""
