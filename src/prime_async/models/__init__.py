"""prime_async.models"""
