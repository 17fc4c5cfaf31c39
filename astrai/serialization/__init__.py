"""astrai.serialization"""
