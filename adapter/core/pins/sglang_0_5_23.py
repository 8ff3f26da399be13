"""The pin table for SGLang 0.5.23 (with flashinfer-python 0.7.2 and torch 2.14.1): data only.

``"module:qualname" -> sha256(inspect.getsource(inspect.unwrap(fn)))`` for every upstream function
a switch wraps or relies on. A new pin is added by hand after reading the function, never generated
blindly; ``python -m adapter pins`` prints the installed hashes.
"""

UPSTREAM = {"sglang": "0.5.23", "flashinfer-python": "0.7.2", "torch": "2.14.1"}

PINS: dict[str, str] = {
    # autotune_keep
    "sglang.srt.model_executor.runner.flashinfer_autotune:_autotune_cache_digest": (
        "a45e23d0dd3c93eaf7895cb5051091c2ffffff7c1b1233bdef5168282b7c6c6b"
    ),
    "sglang.srt.model_executor.runner.flashinfer_autotune:flashinfer_autotune_context": (
        "0a4d2304bc899b5e8afec773d7333cd145b0171b30430a0c2b1e7dd7de93ea51"
    ),
    # page_rounded_admission (wrapped)
    "sglang.srt.managers.schedule_policy:PrefillAdder._get_running_request_total_token_offset": (
        "64fd33f1c3fee43bd659c89c36274155636d11725fa896aac1fc58c3483c5275"
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder.__init__": (
        "311684cd26be5b49ecc864a1f5adabf6263513b986c4d8d5738703b8d58615aa"
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder._check_prefill_budget": (
        "090134788039bbb48c6f510e1a876e17204fbea4e1afb21e94161783ffe9b17f"
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder._update_prefill_budget": (
        "63965ae1945bd25ffa773e73e0c1976d13bc914d542863ec2a5c6fd6b6b3c150"
    ),
    "sglang.srt.managers.scheduler:Scheduler.init_req_max_new_tokens": (
        "ea5d8cf1e6bf45ac74c991156882153117a19c9ddb2e97466eed48ec91cfe6a8"
    ),
    # page_rounded_admission (pinned, not wrapped: the arithmetic its wrappers replace)
    "sglang.srt.mem_cache.prefill_budget:PrefillBudget.reserve": (
        "81106a62693358040771b92b9fbce3d6322363ea3b5ae2036cde6111a3fd0c6d"
    ),
    "sglang.srt.mem_cache.prefill_budget:PrefillBudget.check_prefill": (
        "3496f9d9e0e8c0ed05b461f88be871c63d337a709960a1eea73eb258ce82ecb5"
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req": (
        "11ea292b16f33cb686bf72862fee68949b2586dac1b4c42a45525c6b43c17f7f"
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder._select_prefill_admission": (
        "c17c45f9e1e609c65f2ddf85e1e8e97ace80f259e0b44113de81545f14b45662"
    ),
    "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.max_new_tokens_for_memory": (
        "69701e5fec1eb452aee8cc95f4cb6d01a3e39d1407d66adb80f0d3ae92432187"
    ),
    # fast_tree_core
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._insert_walk_step": (
        "e05a13b0ebcb98f584587bd42842aa4fe7337c9b13715eda4681da8f5227f5c2"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._finish_insert_walk_node": (
        "952475c4b33f48283b0d5b568195b9e55bdf8fabfda3341a27e654d3b3b8af17"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._insert_commit_step": (
        "0b4f537155f635bd8d45886e1a9292fffd8d3c8e64209d6aebf7f9d38d6cafeb"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._insert_overlap_step": (
        "6674cf49e0b8d7f6038bceb075bd79d83559afd5c4f3772d3c7abdcfe0adb4fe"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._touch_node": (
        "2903de6a567b669f76dc557a7f0b2d9b997faaf6d9fd98b42988b38dc4eae31a"
    ),
    "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.update_component_on_insert_overlap": (
        "03feead801e19dbcffe977f84608b6987d4496356ccb9470f469688420ddb1eb"
    ),
    "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.refresh_lru": (
        "cb4932a420de8a80d296ea8a1c6b6a6a7eb55982b74ace1d66ffd69e41573f0f"
    ),
    "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.update_component_on_insert_overlap": (
        "34a714325de3a56b07ec40e7be7a5a788b73a3cdec234296cb9888c7b13640f7"
    ),
    # fast_tree_core (wrapped: the match walk and the Full lock walks)
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._match_prefix_helper": (
        "0f2b6aef0c37c86f024a586159b083400be9f0d445fcb0a6254b99f38c7c75fb"
    ),
    "sglang.srt.mem_cache.unified_cache.components.full:FullComponent.acquire_component_lock": (
        "73fc2807a3f10349d477334c25a88da157ddd76eaea3883008c7a5d38105fb34"
    ),
    "sglang.srt.mem_cache.unified_cache.components.full:FullComponent.release_component_lock": (
        "a50962eb41cb9dfc01828a412a985c0752845ecba62340b872cb2ffc21069d20"
    ),
    # fast_tree_core (pinned, not wrapped: the barrier rule the multi-node walk step keeps, the hit count,
    # leaf-set and value-length methods it inlines, the child-key filing its child scan relies on, and
    # the key methods whose answers it reproduces)
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._advance_insert": (
        "b59e53571f56e5b874a16b0e8e575cc62c9bcddaaaa30efde13ce497759a3303"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._inc_hit_count_and_check": (
        "ee042b6f6227e9233275eb0987a5f4ca9a7962e652bcf2f9dae97d9f6529c3b7"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._update_evictable_leaf_sets": (
        "c37800284e06624ea4363db108e69071e09fab57bd558bce265806fd8da61e9c"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._is_device_leaf": (
        "e05419d912e821742ca05bb55d7bbc285fe283e2c3893c2db3bec6c82d834933"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._is_host_leaf": (
        "818e9936b02213a16a21db687031187f1eaa3cfdae375b316495ef26f4c6d298"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._split_node": (
        "069693552db78cef4cd9a03367c2e2a5599680b502f89be958b2eb90c4069016"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._add_new_node": (
        "5c287b8918f6024691af0be2229dfd6d829679ad4d30e19fd198522dfc449c12"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.insert_host": (
        "a5ea822ca4930af43dd882ea8f9ac3b8aca3588c537f090030e87a95c1914c72"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeNode.evicted.fget": (
        "f6763ea35837b3ca14531040e968d19ce173c58b0749f44699cd7a8fe532d1f2"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeNode.backuped.fget": (
        "5d48e2f82d7a240a0bfa51fd1af74063a385c0274249e6a615e1582212849e0f"
    ),
    "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.value_len": (
        "dcc878a98161953b5a1f1a911459c4d84c2014a576daf68623af31859c69a282"
    ),
    "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.reclaimable_value_len": (
        "8b604db4a2d8daa5c543a946ef9776e239aa4bef7575713c7abc925187b9de34"
    ),
    "sglang.srt.mem_cache.radix_cache:RadixKey.child_key_at": (
        "78d8fdf7fe5339649c6652a6135745c45b4afe641676abadc70ba1fb5501de01"
    ),
    "sglang.srt.mem_cache.radix_cache:RadixKey.match_at": (
        "3af84653132e239dadc2b3b86c211adc66dc11a9974b6af700ac005fedf3b83e"
    ),
    # swa_thin
    # (HiCache write-back: counts a new leaf's creator as the other policies do; _inc_hit_count_and_check
    # is pinned with fast_tree_core)
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._should_backup_after_insert": (
        "2591b96f6c167e2e72b253cab41825260dab952703e428026f41eed16febc026"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.checkpoint_into_tree": (
        "3a20fa5c0617352cc19485b47d5fc54b429288fe6deb62747ed95f4fd7ffd098"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedLRUList._remove_node": (
        "e0101fd38b9dc80111fa9fd6b043faf7e442da4586105f912bea4fc097e0d8fb"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedLRUList._add_node_after": (
        "7b84b69969bc04730bec910f80927121f6de0a96499d8801b4a21f24b7abcae1"
    ),
    # decode_yield
    "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run": (
        "34f30fd4dfb13d741ef8aae209ca7de67fa00846ee58ffa7706fc3b12890fae0"
    ),
    "sglang.srt.managers.scheduler:Scheduler._should_defer_prefill": (
        "fbdbb2ae5a7e7086d980af305f19f5a25791c5db92f450dc22f349e4c28e12b3"
    ),
    "sglang.srt.managers.scheduler:Scheduler._arm_prefill_decode_interval": (
        "54db911b31a3cfcb1f4e2463d9d9e39b9e31cc3579c9df487cf48265b2be6933"
    ),
    "sglang.srt.managers.scheduler:Scheduler._reqs_finishing_inflight": (
        "0a23fa4468031e1d72d71106ef992f899155249b6d59d2afb1ae0cc27960729e"
    ),
    "sglang.srt.managers.schedule_policy:SchedulePolicy.calc_priority": (
        "7584774bd710d20ea1b05d1b8900f8e029f981844a5cd9e02f92d8ac23f9f1d3"
    ),
    "sglang.srt.mem_cache.common:_req_radix_key": (
        "b5b809c3289c6a64ced1212e5c8d50a6739578ed91f09d7e6909eea9754fdf9d"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.swa_tombstone_ranges": (
        "c09e9a49fdd4b3dfb9dbc2b4d973d9a3cce14446e31612163d7081c95ed5cee1"
    ),
    "sglang.srt.mem_cache.rust_tree_core.adapter:RustUnifiedTreeCore.match_full_device_prefix": (
        "213177b6400361294adbd58083cfce3352eb43cef8684df73741154246110fef"
    ),
    "sglang.srt.mem_cache.rust_tree_core.adapter:RustUnifiedTreeCore.swa_tombstone_ranges": (
        "3c4eca0bfeacfc249dd271fe83062ab38b02f91cd8a6f1f121d610d7ca526c69"
    ),
    # swa_native_decode
    "sglang.kernels.ops.attention.flash_mla_sm120:_flash_mla_flashinfer": (
        "dc287221ffafd0d4311863acfc34ba8183c8230f03508e191db96b3bc97a4acb"
    ),
    "sglang.kernels.ops.attention.flash_mla_sm120:_flash_mla_sm120_prefill": (
        "760ccf6f7b8e24661a14b8e0a93d3f692f47ceaba97ed0f4c73b4b88b157e421"
    ),
    # kv_park (also wraps Scheduler.get_next_batch_to_run, pinned above under decode_yield)
    "sglang.srt.managers.schedule_batch:release_req": (
        "e9a690b5c7084bb5f69496e1b8e200a75a05db87a7232dc66bdbb5feba112c43"
    ),
    "sglang.srt.mem_cache.kv_cache_builder:build_kv_cache": (
        "70324baea106836dea1894731e1c43f928f84c0ce7cfddd9bf9bae6d9eaaf856"
    ),
    # kv_park (pinned, not wrapped: the DSV4 regions and order parked per page-id space, the C4
    # state addressing that makes state rows follow SWA pages, and the retract loop that rules
    # out holding pages in the allocator while a copy is in flight)
    "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.get_contiguous_buf_infos": (
        "5f30ae1eaa234041062e5d871427c37a7245a01086ec3a7154cd251241613e3d"
    ),
    "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.get_state_buf_infos": (
        "ff7684b4d9673071d077ad44b451514e1f15b3a03006adb190e699daf99d6a4a"
    ),
    "sglang.srt.mem_cache.deepseek_v4_compress_state:CompressStatePool.translate_from_swa_loc_to_state_loc": (
        "fadcb223853e5cd0b78a3183ccf352610179071697b6f3ecf5726703b551ea04"
    ),
    "sglang.srt.managers.schedule_batch:ScheduleBatch.retract_decode": (
        "aa8b1c7e5e790ab79f4d8933b0ff811ab450bd5ced042306dbfe98f0a6237a06"
    ),
    # cone_replay (wrapped; PrefillAdder._select_prefill_admission is pinned above, same hash)
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.__init__": (
        "cc144f4312cfcd7108e7d52717622db6c42f7d62a8cc9ccbf38fd623411906a5"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.match_prefix": (
        "8cd7f2cc3958b7250fe8218cbeaa206d9939c6c05c08a318cf03f832a7b1a74b"
    ),
    "sglang.srt.managers.schedule_batch:ScheduleBatch.prepare_for_extend": (
        "e7ca2d0e335a570e2c731f3dc2869899f16f223dbc13d1ce688fbdd3040eef62"
    ),
    # cone_replay (wrapped, forward side: the replay rows of a batch, their Full K/V, no prefill graph)
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new": (
        "1f92fa245fced357d681c76ce8b7874c4b1fab10380a8eb3f88243c6ab7aa35f"
    ),
    "sglang.srt.layers.radix_attention:RadixAttention.forward": (
        "4ca2cac7fefcd32bc21a3e137201b292bb933a1c95f697cfad56e346e4a98dcb"
    ),
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph": (
        "2c4349416d987ef50243f2449277d985ce65aa304384e0a40d1a3d370f9db49e"
    ),
    "sglang.srt.model_executor.model_runner:ModelRunner.forward": (
        "19034759e5d5ec511c71cfd535d168a4b7d48040e0b895321f12d7233e27b88f"
    ),
    # cone_replay (wrapped, beside HiCache: F's Full KV loaded back without the SWA component's transfer)
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.build_load_back_spec": (
        "51fcb497d95115e7e0633ce89f1868bc805d6a40f451159bba2fe1f93108a696"
    ),
    "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.build_hicache_transfers": (
        "60103170c3ee342089e0f2fa767bd8ea16e81f3ff0761a78ffc52bb42ab7b8e5"
    ),
    # cone_replay (relied on, beside HiCache: the load-back the cone runs through init_load_back, its
    # Full-only spec, the adder's load-back budget, the copy's wait for the batch's load event)
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.load_back": (
        "40239d4f78e6af9d686effb94b834be8d8a8de9d55a5982d90afd20dd941cc59"
    ),
    "sglang.srt.mem_cache.unified_cache.components.full:FullComponent.build_hicache_transfers": (
        "0093ca25e9458ca3e09a74c1e57bdfa60fceae37f61da070926f8aa11173c48e"
    ),
    "sglang.srt.mem_cache.prefill_budget:PrefillBudget.prepare_load_back": (
        "918948dffefbc067562d52990f8fca43646370348e45b147d18d09da3c2ab318"
    ),
    "sglang.srt.mem_cache.prefill_budget:SharedSWAPrefillBudget.prepare_load_back": (
        "d9b00ba98dc2e1d4348e19c9713e9dcb425955fc79271bf9ac8eba18558e52f9"
    ),
    "sglang.srt.managers.cache_controller:LayerLoadingEvent.wait": (
        "6f2d7033e2cda24ddc4109f9b1facb977f83580f792d99bba2e5c355a359c2c0"
    ),
    # cone_replay (pinned, not wrapped: F's definition, the fields a fallback restores, the anchor lock)
    # Beside HiCache: B, the stock resume point after load-back (init_load_back splices up to
    # best_match_node), read through collect_path_info; whether the load left F's node on device.
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.init_load_back": (
        "93968501bc8782f0b5305bc41a563955ed5cf59e8f08f29978d8e721cc247b22"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.collect_path_info": (
        "b6443bb10f9ef444b4772c6806e6a9c8161e85b73265fb94e843ba5ab9e927fc"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.is_full_device_evicted": (
        "9e88f96dd87b0b31bdb998c4fb20794713276c2395ed7a3fda809c988d57cc51"
    ),
    "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.finalize_match_result_in_tree_core": (
        "e680eab5d5c255cae6ef9a6dcbb14b32ca172ca371c3d6f1b7c63f36462531bf"
    ),
    "sglang.srt.mem_cache.common:match_kv_cache": (
        "1f3b0e2c895cf0ad687d3f98329b74d0aab90e85babc2d105806fe176b7de009"
    ),
    "sglang.srt.managers.schedule_policy:PrefillAdder._commit_prefill_admission": (
        "6151e6da5dfb0b6f7a8a8a8ecd50a3c85b1abc5a6dc4de858523750327bf006e"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.path_device_indices": (
        "c32a8f4f29a0983a7a0550a31dbdaad8aed809d6a0d62c7e0853d3120c6ecf25"
    ),
    # kv_park (relied on: the running rows' next decode step beside pinned restored pages)
    "sglang.srt.managers.schedule_batch:ScheduleBatch.new_tokens_required_next_decode": (
        "07c2a70043ca0d60eb7c5db6a315e761c70afecfca578411bfcba7ccd78de3aa"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.evictable_size": (
        "bc75445afbcece688c3162a462f371573b4322569d5a684dcf225e283283bef5"
    ),
    # autotune_keep (relied on: called with a fixed signature)
    "sglang.srt.model_executor.runner.flashinfer_autotune:flashinfer_autotune_cache_path": (
        "ec0dfed9ee017eaa1e555dd6596cc32f115d4f7af6bc83767f4d6105859c0814"
    ),
    # decode_yield (relied on: called with a fixed signature)
    "sglang.srt.model_executor.forward_batch_info:ForwardMode.is_extend": (
        "6701c016b33e7c71c59e999fd0a33d7dafdd9832110d7b3a28875f47f983277c"
    ),
    "sglang.srt.managers.schedule_batch:Req.finished": (
        "e9520ce0af62f8c7ecd751d9f603a65cff9cfc3752c13e4f7a656d74021384fc"
    ),
    "sglang.srt.managers.schedule_batch:ScheduleBatch.is_empty": (
        "d54771bae682d3f8e5c4e967e3d12a3d13bf17569f3a819cf1a11b5e2fd25c54"
    ),
    "sglang.srt.managers.schedule_batch:ScheduleBatch.batch_size": (
        "6c1a4da7e1599462dc937a51cf49070e3eb130179d1308a45322ba00f66f4f5f"
    ),
    # decode_yield (relied on: sets Scheduler.tp_cpu_group, the group the window is broadcast on)
    "sglang.srt.managers.scheduler:Scheduler.init_model_worker": (
        "450aebf5b90767f5fe3ccef5dac16f2f56fc66a40f73a4c97d4191df013cbe28"
    ),
    # fast_tree_core (relied on: called with a fixed signature)
    "sglang.srt.mem_cache.unified_cache.components.swa:SWAComponent.recover_after_unevict": (
        "e7f4f68e006db530c55e2f84ca31d069cc9a1d7ed716191bf176ad4933f974b5"
    ),
    "sglang.srt.mem_cache.unified_cache.components.base:TreeComponent.recover_after_unevict": (
        "a3f14d58e0aee51e1356e52ea40a94550b1b7c78c3209b2b1286165b3994f92c"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._unevict_node_on_insert": (
        "33279cd4c9cc81107cfa46871fa6bb3f254b2778115607421743e87d1ff190bd"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._match_post_processor": (
        "1e99a48a0b7a70b4a318209dba44c8697a0067ea5ac5ac8611e825f317209b00"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._create_match_validators": (
        "fe1759b435032eeb1f1408c247373b946ded6a73a990d73631b09d45590b1ecb"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._build_backup_kv_action": (
        "f6914f4e94b5bd3e2e91d73d5aad3b9459f764004e7a5b67ec010f67acde0f93"
    ),
    # swa_thin (relied on: called with a fixed signature)
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.node_by_id": (
        "59322165f943bea001822f59f2328d5a7457b68b62e4515caeb05c5860c94469"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.is_root": (
        "2f25b7d769e668bc3ba96ebe483ba1d5f0179db1ee4f0d9e88000bbe31708a24"
    ),
    # cone_replay (relied on, DeepSeek-V4: the compressor write mask; store-then-read in every layer)
    "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend._compressor_out_loc": (
        "bc820d2c6b43e31313e4da5944edb54441d9aae013b2140d63a6f0a43868fd32"
    ),
    "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend._forward_attention": (
        "6e3dd09145897339bfdef95cf0a20f8f728182ad53b4ca4481b47cb6ff005e87"
    ),
    # cone_replay (relied on, decoder SWA bounded replay: the tail rows and their window floor)
    "sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.write_tail_source_kv": (
        "b19a61a3f397aa4729c576147b9e0bbb756c2e72d080491e019848040a042995"
    ),
    "sglang.kernels.ops.attention.dsv4.attn_metadata_kernels:late_layer_tail_layout": (
        "1e0617c2cbe527b86109ff864d7238e87eefa91049bd8cb0a41ec3559d63e274"
    ),
    # cone_replay (relied on: called with a fixed signature)
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.get_kvcache": (
        "5202e7dfdfe1c33e92ababe7a673ea3ba5f724999466889183b826cc1fd334dc"
    ),
    "sglang.srt.mem_cache.swa_memory_pool:SWAKVPool.get_value_buffer": (
        "dea59edd08407dab8cb0720745d34a0816a60d776af7b714f4bc2af8924a9519"
    ),
    "sglang.srt.mem_cache.swa_memory_pool:SWAKVPool.get_key_buffer": (
        "6c0abee24fc66cde1d444458259383f33c1c77f4369d51571e6183ae4cae8b8b"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.match_full_device_prefix": (
        "72b28eb6114dcec72450c87fd9555abe07561bda6b8ece52cbdfa8ed4cf955a7"
    ),
    # page_rounded_admission (relied on: called with a fixed signature)
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_mamba": (
        "dc5bc0d6149525f16368586d8864155b82e5be1671a452be8ce29c4b83434aaa"
    ),
    # kv_park (relied on: called with a fixed signature)
    # Beside HiCache: a window page the tree still holds past what it serves (on the device or host
    # only; the Rust tree core's adapter has the same two calls) is never parked twice.
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.get_component_device_value": (
        "4373877c8e2a4b9869e419ee700b208379cba1e7a5c33db2392abe58cca9f692"
    ),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.component_has_host_value_only": (
        "973e07684c253af43a0724ec7a874c1830825723a4ad5ca425501af95adf7322"
    ),
    "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4IndexerPool.contiguous_page_row_buffers": (
        "d9895e530c1d4e5e365407b8f9b6cba0bb04b873f298325f0dd7376c2e1b5186"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_swa": (
        "04e4ad4e7e47c818d199e1256d87f08344a1b3deee07d35b52d97802907ff724"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.supports_prefix_sharing": (
        "c24dd42b365a9810f08401bc2aa2ea0c27d4a0027ebd8bee526dbb3b3c0f807f"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.unlock": (
        "d991ce36e5f47b7fc5284cd58959bca32e162a25eef9323871a9a9670bc561f6"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.lock": (
        "e3802e4c275190aa65cbab0b4b6e9a722313c181e14c214a6e1cad47e58116d0"
    ),
    "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.insert": (
        "d52f1e426adef13cd320240d1cb64dab81c840501d20c12d5b09dc92bbe0beac"
    ),
    "sglang.srt.mem_cache.common:evict_from_tree_cache": (
        "7ce32fb173d53a7db266de99189248cdb067add9ca81474347c6bcaa6812fb58"
    ),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free_swa": (
        "a8100b2320e9ea2790b1de78629f62ca2da884d3d88486b11d00c97c0408ee13"
    ),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.free": (
        "b3c3992b897bd755918e3b775e777d2c421b94300c3c9cfa488dd3e0c389c988"
    ),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.alloc": (
        "032787c875adb9d6fb4acd6fbc19f6f9c0fb47c30acc004f747165fa3d42a4e5"
    ),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.available_size": (
        "8e3b461664c8107cea6ad90d85cf65d80584167a3ed90b1d7563ce383fc5b132"
    ),
    "sglang.srt.mem_cache.allocator.swa:SWATokenToKVPoolAllocator.alloc_extend_swa_tail": (
        "6ad248b0488145f9a05e16a4370813a5c3b06940e9b12100ddb8c9b920685919"
    ),
    "sglang.srt.managers.schedule_batch:ReqKvInfo.set_evicted_seqlen": (
        "4500564864183d82c6cafb7acae4de84f4ef5646943f01c0dfa66189e2b4cdac"
    ),
    "sglang.srt.managers.schedule_batch:Req._compute_max_prefix_len": (
        "28ac28ced09b6cb7bbf0f69febbcba4103cd96b90c362a9ae354093a58686a74"
    ),
    # kv_park (wrapped: the DSV4 pool's CPU copy and load, sglang#33385, and the rebootstrap decision;
    # relied on: their callers, the DSV4 mapping and state rings, and HiCache's host slot allocator)
    "sglang.srt.mem_cache.memory_pool:KVCache.get_cpu_copy": (
        "49376fffe6de8a24b8b4d89f4f02d59baf83e307444cafa0d4b21b3d11e6fd90"
    ),
    "sglang.srt.mem_cache.memory_pool:KVCache.load_cpu_copy": (
        "8159a3a88522cf3f0280e43c80bcefb95b72c085e7a20139cc262cd231a301ff"
    ),
    "sglang.srt.mem_cache.common:dsv4_needs_rebootstrap": (
        "4239399b59761469c9a472a1da5ad11159725ce4238c5b41a427947c9998103e"
    ),
    "sglang.srt.disaggregation.decode:dsv4_needs_rebootstrap": (
        "4239399b59761469c9a472a1da5ad11159725ce4238c5b41a427947c9998103e"
    ),
    "sglang.srt.managers.schedule_batch:Req.offload_kv_cache": (
        "58756a6939f8eb368862931f7aaa6533a73c07e03a2d2511d8f7ca6c4c96c033"
    ),
    "sglang.srt.managers.schedule_batch:Req.load_kv_cache": (
        "70a47fe2caff96b90d6fcbb6f5cbc6c5774abbb143656e10b45f8026949ab23b"
    ),
    "sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.translate_loc_from_full_to_swa": (
        "d7280c8fa4a4828a262f06fd9c43786220a32ba9d854df2ed7fc8a8c13bbfaee"
    ),
    "sglang.srt.mem_cache.deepseek_v4_compress_state:CompressStatePool.translate_from_req_position_to_state_loc": (
        "7496d7d7ccaa061c5e26fcc5b75786a8f02c2b37b8343efc188f645b872f2286"
    ),
    "sglang.srt.mem_cache.pool_host.base:HostKVCache.alloc": (
        "39f2e5fd15250b98221bbb7951c89b77abf92a7f6604ba94e3a7c7d338f3b02f"
    ),
    "sglang.srt.mem_cache.pool_host.base:HostKVCache.free": (
        "eb78333d2e64be5a55eddee34550dc71df88c3a4b266440e3cf136f123ebb11d"
    ),
    # kv_park (pinned, not wrapped): under the overlap loop the forward runs on the scheduler's
    # forward stream (parking copies follow it through events), as HiCache's backup copy does.
    "sglang.srt.managers.scheduler:Scheduler.run_batch": (
        "4e9bb4d5e649e2f169fcc5d0621a2218d0046acc13d121e6065e41cca40ce495"
    ),
    "sglang.srt.managers.cache_controller:HiCacheController.start_writing": (
        "2278ab54c5b038de24afecc478ca82049dc134c7f56a3b69a05fd5db46b4879f"
    ),
    # kv_park (wrapped: torch's CUDA graph capture seam, for the capture lock)
    "torch.cuda.graphs:CUDAGraph.capture_begin": (
        "ba451719cb5f4a81a168ed1978d01bbe39fcdcc8be20c49ab2e9014ac198904b"
    ),
    "torch.cuda.graphs:CUDAGraph.capture_end": (
        "96030f5b02bb86148401ae39a6706da5177613865c04951934762e00d91e94da"
    ),
    "torch.cuda.graphs:is_current_stream_capturing": (
        "46ad9fe4332b954e95845a39a7d8fd52779535c58c9118236f55192d3995d155"
    ),
    # the boot's rank hook (registry.BOOT_PINNED; wrapped, then relied on: publish runs before it)
    "sglang.srt.managers.scheduler:configure_scheduler_process": (
        "6ab317d62062e9c15301c3d46e83f69dbfd23cf5b77677bc1a0c2362c5070af2"
    ),
    "sglang.srt.managers.scheduler:run_scheduler_process": (
        "f52f0de806e29a75440839ff0cb3af43405304789adc571585ffd83a8a5c721b"
    ),
    # the plugin entry point (adapter.core.plugin.PINNED; relied on: it catches Exception only, so the
    # plugin's SystemExit stops the boot)
    "sglang.srt.plugins:load_plugins": (
        "cd2a423a31293f61ca0e01cfeb4ca9ba554b8be1b464e0130cec49aca18fa89e"
    ),
    # -- end of pins (add new pins above this line, grouped under a comment naming the switch) --
}
