"""Chat templates of the three tool-call syntax families, written for the tests in the shape each family's models
use (tools in the system turn or before the last user turn, calls and tool results rendered back), over the bundled
tokenizer's vocabulary (its own template is ChatML without tools)."""

# Hermes / Qwen: <tool_call> blocks, tool results as <tool_response>, think tags that enable_thinking=false closes
HERMES_THINK = """
{%- if tools %}<|im_start|>system
You may call one or more functions. Their signatures:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

# Llama 3.1-3.3: a call is the whole answer, {"name", "parameters"}; tool results in the ipython role
LLAMA3_JSON = """<|begin_of_text|>
{%- if tools %}<|start_header_id|>system<|end_header_id|>

To call a function, answer only {"name": function name, "parameters": its arguments}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral: [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS] as a JSON list
MISTRAL = """<s>
{%- for m in messages %}
{%- if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]\
{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS]\
{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}{% endif %}</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}{{ m.content }}

{% endif %}
{%- endfor %}"""
