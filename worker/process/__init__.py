"""The worker process: its RQ workers, the job function and its stream, stopping, registration, supervision."""
