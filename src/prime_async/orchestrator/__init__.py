"""prime_async.orchestrator"""
